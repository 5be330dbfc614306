import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.models.packed_vit import pack_images
from vgraph_compile.ops import varlen_attention
from vgraph_compile.passes import discover_varlen


def test_roles_from_data_flow(tiny):
    """Token rows, cu_seqlens and max_seqlen are told apart by how they reach the attention, not by names."""
    _, gm, ctx = tiny
    before = gm.code
    discover_varlen.run(gm, ctx)
    assert gm.code == before, "an analysis must not change the graph"
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: patches.shape[0]
group 0: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended']
input patches: tokens dims=[0]
input cu_seqlens: segment_offsets dims=[0] group=0
input max_seqlen: max_seqlen group=0
inputs: 18 parameters and module state (used in place)""",
    )


class TwoGroups(torch.nn.Module):
    """Full attention over frames, then window attention, and a window permutation (a gather index)."""

    def forward(self, x, cu_full, max_full, cu_window, max_window, window_index):
        q = x.view(x.shape[0], 2, -1)
        full = varlen_attention(q, q, q, cu_full, max_full)
        permuted = full[window_index]
        window = varlen_attention(permuted, permuted, permuted, cu_window, max_window)
        return window.reshape(x.shape[0], -1), torch.nn.functional.embedding(window_index, torch.ones(64, 3))


def test_groups_and_index_roles():
    x = torch.randn(32, 8)
    cu_full = torch.tensor([0, 16, 32], dtype=torch.int32)
    cu_window = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)
    gm, ctx = trace(TwoGroups(), x, cu_full, 16, cu_window, 8, torch.randperm(32))
    discover_varlen.run(gm, ctx)
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: x.shape[0]
group 0: offsets=cu_full segments=cu_full.shape[0] - 1 sites=['full']
group 1: offsets=cu_window segments=cu_window.shape[0] - 1 sites=['window']
input x: tokens dims=[0]
input cu_full: segment_offsets dims=[0] group=0
input max_full: max_seqlen group=0
input window_index: gather_index dims=[0]
input cu_window: segment_offsets dims=[0] group=1
input max_window: max_seqlen group=1
inputs: 0 parameters and module state (used in place)""",
    )


def test_refuses_a_graph_without_varlen_attention():
    gm, ctx = trace(lambda x, cu: x * 2 + cu.sum(), torch.randn(6, 4), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="no varlen-attention call found"):
        discover_varlen.run(gm, ctx)


def test_refuses_a_host_sync_inside_the_graph():
    def encoder(x, cu):
        q = x.view(x.shape[0], 1, -1)
        return varlen_attention(q, q, q, cu, int((cu[1:] - cu[:-1]).max().item()))

    gm, ctx = trace(encoder, torch.randn(6, 4), torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="data-dependent value"):
        discover_varlen.run(gm, ctx)


def test_refuses_int64_cu_seqlens(tiny):
    model, _, _ = tiny
    patches, cu, max_seqlen = pack_images([5, 7], 12)
    gm, ctx = trace(model, patches, cu.long(), max_seqlen)
    with pytest.raises(ValueError, match="is torch.int64: varlen kernels read int32 offsets"):
        discover_varlen.run(gm, ctx)
