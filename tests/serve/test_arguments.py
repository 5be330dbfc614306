"""The hot path's argument reading: graph inputs from the call's own arguments, retrace-worthy calls told apart,
the encoder's return value rebuilt from the runtime's outputs."""

import gc
import weakref

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.serve.arguments import OutputLayout


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()


def _scaled_encoder(model):
    """``model`` with a float ``scale`` the trace specializes, compiled and traced on two images."""

    def encode(patches, cu_seqlens, max_seqlen, scale=1.0):
        return model(patches, cu_seqlens, max_seqlen) * scale

    compiled = vgraph_compile.encoder(encode, token_budgets=(16, 64), max_segments=4, compiler="eager")
    inputs = pack_images([5, 7], 12)
    with torch.no_grad():
        compiled(*inputs)
    return compiled, inputs


def test_hot_path_reads_arguments_by_name_and_position(model):
    """After the trace, positional and keyword calls are served with no dynamo call (no trace, replays only)."""

    def encode(patches, cu_seqlens, max_seqlen, scale=1.0):
        return model(patches, cu_seqlens, max_seqlen) * scale, patches.shape[0]

    compiled = vgraph_compile.encoder(encode, token_budgets=(16, 64), max_segments=4, compiler="eager")
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
        patches, cu, max_seqlen = pack_images([20, 3], 12)
        with counters.expect(replays=2):
            out, rows = compiled(patches, cu, max_seqlen)
            keyword, _ = compiled(patches, max_seqlen=max_seqlen, cu_seqlens=cu)
    torch.testing.assert_close(out, model(patches, cu, max_seqlen), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keyword, out)
    assert rows == 23


def test_an_argument_the_trace_never_read_may_change_on_the_hot_path(model):
    """``window`` is an int the encoder takes and never reads (a window-only tower's ``max_seqlen``): dynamo guards
    nothing on it, so another value replays with no trace; ``scale``, which the trace read, still traces again."""

    def encode(patches, cu_seqlens, max_seqlen, window=64, scale=1.0):
        return model(patches, cu_seqlens, max_seqlen) * scale

    compiled = vgraph_compile.encoder(encode, token_budgets=(16, 64), max_segments=4, compiler="eager")
    inputs = pack_images([5, 7], 12)
    with torch.no_grad():
        compiled(*inputs)
        arguments = compiled._hot.arguments
        assert arguments.read(inputs, {"window": 500}) is not None and arguments.read(inputs, {"scale": 2.0}) is None
        with counters.expect(replays=2):
            for window in (1, 500):
                torch.testing.assert_close(compiled(*inputs, window=window), model(*inputs), rtol=1e-5, atol=1e-5)
        with counters.expect(traces=1, sites_found=1, buckets_built=2, nodes_rewritten=2, replays=1):
            compiled(*inputs, window=3, scale=2.0)


def test_a_specialized_argument_goes_back_through_dynamo(model):
    """``scale`` is a float the trace specialized: another value is a new trace, never a stale constant."""
    compiled, inputs = _scaled_encoder(model)
    with torch.no_grad():
        with counters.expect(traces=1, sites_found=1, buckets_built=2, nodes_rewritten=2, replays=1):
            doubled = compiled(*inputs, scale=2.0)
        torch.testing.assert_close(doubled, 2 * model(*inputs), rtol=1e-5, atol=1e-5)


def test_output_layout_matches_by_identity():
    a, b = torch.zeros(2), torch.ones(3)
    layout = OutputLayout.match((b, [a, None]), [a, b])
    rebuilt = layout.build([a + 1, b + 1])
    assert isinstance(rebuilt, tuple) and isinstance(rebuilt[1], list) and rebuilt[1][1] is None
    torch.testing.assert_close(rebuilt[0], b + 1)
    assert OutputLayout.match(torch.zeros(1), [a, b]) is None  # a tensor that is no graph output


def test_rebuilt_outputs_die_with_their_last_reference_not_at_the_next_collection():
    """A reference cycle around a call's outputs keeps the device memory of every call until the cyclic garbage
    collector runs: the outputs must be freed as soon as the caller drops them."""
    a, b = torch.zeros(2), torch.ones(3)
    layout = OutputLayout.match((b, [a, None]), [a, b])
    enabled = gc.isenabled()
    gc.disable()
    try:
        outputs = [torch.zeros(4), torch.ones(5)]
        rebuilt = layout.build(outputs)
        alive = [weakref.ref(tensor) for tensor in outputs]
        del outputs, rebuilt
        assert [ref() for ref in alive] == [None, None]
    finally:
        if enabled:
            gc.enable()


def test_var_keyword_forward_reads_positional_calls_as_bind_does(model):
    """A forward ``(patches, **metadata)`` (the HF towers' traced call) is served from positional pixels and
    keyword metadata with no dynamo call, equal to eager; a call that passes ``patches`` twice is no hot-path call
    (``read`` says retrace, and dynamo raises the TypeError the forward would)."""

    def encode(patches, **metadata):
        return model(patches, metadata["cu_seqlens"], metadata["max_seqlen"])

    compiled = vgraph_compile.encoder(encode, token_budgets=(16, 64), max_segments=4, compiler="eager")
    with torch.no_grad():
        patches, cu, max_seqlen = pack_images([5, 7], 12)
        compiled(patches, cu_seqlens=cu, max_seqlen=max_seqlen)
        patches, cu, max_seqlen = pack_images([20, 3], 12)
        with counters.expect(replays=1):
            out = compiled(patches, cu_seqlens=cu, max_seqlen=max_seqlen)
        assert compiled._hot.arguments.read((patches,), {"patches": patches, "cu_seqlens": cu}) is None
    torch.testing.assert_close(out, model(patches, cu, max_seqlen), rtol=1e-5, atol=1e-5)


def test_a_key_skips_the_fingerprint_only_after_a_matching_call(model):
    """A keyed call is fingerprinted until one call with its key matched the trace; a key whose call differed (a
    specialized argument's other value) is not remembered, so its next call is told apart again."""
    compiled, inputs = _scaled_encoder(model)
    arguments = compiled._hot.arguments
    assert arguments.read(inputs, {"scale": 2.0}, key="a") is None
    assert arguments.read(inputs, {"scale": 2.0}, key="a") is None
    assert arguments.read(inputs, {}, key="b") is not None
    assert arguments.read(inputs, {"scale": 2.0}, key="b") is not None  # the key's promise: not fingerprinted
