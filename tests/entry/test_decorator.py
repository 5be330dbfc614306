"""``vgraph_compile.encoder``: one trace, then calls past dynamo; autograd calls and calls past dynamo's recompile
limit run the encoder as written; the options refused before anything is traced."""

import logging

import pytest
import torch

import vgraph_compile
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


def attend(x, cu_seqlens, max_seqlen, double=False):
    """Self-attention of each segment's rows, two heads of 4."""
    q = x.view(x.shape[0], 2, 4)
    out = varlen_attention(q, q, q, cu_seqlens, max_seqlen).reshape(x.shape)
    return out * 2 if double else out


def test_config_and_options_together_are_refused():
    message = r"pass either config= or VGraphConfig fields, not both \(got \['max_segments'\]\)"
    with pytest.raises(ValueError, match=message):
        vgraph_compile.encoder(attend, config=VGraphConfig(), max_segments=4)


def test_the_compiled_function_keeps_the_forwards_name_and_docstring():
    compiled = vgraph_compile.encoder(token_budgets=(16,))(attend)
    assert (compiled.__name__, compiled.__doc__) == ("attend", attend.__doc__)


def test_calls_after_the_first_trace_skip_dynamo():
    """The first call traces once; a call of other sizes is then read straight from its arguments (no trace)."""
    compiled = vgraph_compile.encoder(attend, token_budgets=(16, 32), max_segments=4, compiler="eager")
    assert not compiled.traced
    compiled(*pack_images([5, 7], 8))
    assert compiled.traced
    inputs = pack_images([3, 9, 10], 8)
    with counters.expect(replays=1):
        out = compiled(*inputs)
    torch.testing.assert_close(out, attend(*inputs))


def test_autograd_calls_run_the_encoder_as_written():
    """With grad enabled on trainable parameters, the call never reaches dynamo or a bucket: gradients flow."""
    trainable = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8)
    compiled = vgraph_compile.encoder(trainable, token_budgets=(16,), max_segments=4, compiler="eager")
    inputs = pack_images([6, 6], 12)
    with counters.expect():
        out = compiled(*inputs)
    assert out.requires_grad
    torch.testing.assert_close(out, trainable(*inputs))


@torch._dynamo.config.patch(recompile_limit=1)
def test_a_call_past_the_recompile_limit_runs_as_written_counted_and_warned_once(caplog):
    """A specialized flag changed: the call needs a new trace, which dynamo's limit (lowered to 1) refuses."""
    compiled = vgraph_compile.encoder(attend, token_budgets=(16,), max_segments=4, compiler="eager")
    x, cu, max_seqlen = pack_images([5, 7], 8)
    compiled(x, cu, max_seqlen)
    with caplog.at_level(logging.WARNING, logger="vgraph_compile"), counters.expect(eager_fallbacks=2):
        for _ in range(2):
            torch.testing.assert_close(compiled(x, cu, max_seqlen, double=True), attend(x, cu, max_seqlen, True))
    assert [record.message.count("recompile limit") for record in caplog.records] == [1]
