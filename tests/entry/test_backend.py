import importlib.metadata

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


def test_entry_point_is_registered():
    """pip install registers the backend: torch.compile finds "vgraph" without importing the package first."""
    names = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names["vgraph"] == "vgraph_compile.entry.backend:vgraph_backend"
    assert "vgraph" in torch._dynamo.list_backends(exclude_tags=())


def test_string_backend_with_options():
    """With dynamic=True but duck sizing, 12 tokens of width 12 share one symbol: that first trace is static and
    runs eagerly; the next size retraces with symbolic tokens and is served by the buckets."""
    torch._dynamo.reset()
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = torch.compile(
        model,
        backend="vgraph",
        dynamic=True,
        options={"token_budgets": [32, 64], "max_segments": 4, "compiler": "eager"},
    )
    # sites_found: 1 in each of the 2 traces; nodes_rewritten, in the eager and the compiled copy: the kernel of the
    # 1 site, and the 3 norms' eps (plain torch.compile passes them as 0-d inputs read with .item()) = 2 * (1 + 3)
    with (
        torch.no_grad(),
        counters.expect(static_traces=1, traces=1, sites_found=2, buckets_built=2, nodes_rewritten=8, replays=1),
    ):
        for lengths in ([5, 7], [30, 30]):
            inputs = pack_images(lengths, 12)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert vgraph_compile.runtimes()[-1].hits == 1


def test_static_trace_runs_eagerly_and_says_how_to_fix(caplog):
    torch._dynamo.reset()
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = torch.compile(model, backend="vgraph", options={"token_budgets": [32]})
    inputs = pack_images([5, 7], 12)
    with torch.no_grad(), counters.expect(static_traces=1):
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    assert "Pass dynamic=True to torch.compile" in caplog.text


def test_modes_and_bad_options_are_refused():
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    inputs = pack_images([4], 12)
    with pytest.raises(BackendCompilerFailed, match="vgraph takes no torch.compile mode") as refused:
        torch.compile(model, backend="vgraph", mode="reduce-overhead", dynamic=True)(*inputs)
    assert isinstance(refused.value.inner_exception, ValueError)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match=r"unknown vgraph option\(s\) \['budgets'\]") as refused:
        torch.compile(model, backend="vgraph", dynamic=True, options={"budgets": [4]})(*inputs)
    assert isinstance(refused.value.inner_exception, ValueError)


def test_a_retrace_says_what_changed(caplog):
    """torch.compile keeps dynamo's guards: a new grad mode retraces, and the warning names it."""
    torch._dynamo.reset()
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    options = {"token_budgets": [32, 64], "max_segments": 4, "compiler": "eager"}
    compiled = torch.compile(model, backend="vgraph", dynamic=True, options=options)
    inputs = pack_images([5, 9], 12)
    with torch.no_grad():
        compiled(*inputs)
    with torch.inference_mode():
        compiled(*pack_images([6, 9], 12))
    with torch.enable_grad():
        compiled(*pack_images([7, 9], 12))
    assert "vgraph traced the encoder again: grad mode: disabled -> enabled" in caplog.text


@pytest.mark.parametrize("caller", [True, False])
def test_dynamo_traces_without_cudnn_attention_and_the_build_gets_the_callers_setting(caller):
    """SDPA's cuDNN mask check guards a batch of 1: it is off while dynamo traces, and the backend builds with the
    setting the caller had (``VGraphBackend.cudnn_attention``), which is restored after the call."""
    from vgraph_compile.pipeline import cudnn_attention
    from vgraph_compile.entry.trace_options import trace_options

    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    with cudnn_attention(caller):
        with trace_options(()):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled() is caller
        compiled = vgraph_compile.encoder(model, token_budgets=[32, 64], max_segments=4, compiler="eager")
        with torch.no_grad():
            compiled(*pack_images([9, 7], 12))
        assert compiled.vgraph.cudnn_attention is caller and torch.backends.cuda.cudnn_sdp_enabled() is caller
