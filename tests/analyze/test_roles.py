import pytest
import torch
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile

from tests.helpers import trace
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.explain_factories import placed_cls_vit
from vgraph_compile.sample_models.packed_vit import PlacedClsViT, pack_images
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.analyze import discover


class ScatterBack(torch.nn.Module):
    """Attention over permuted rows, then the rows written back to their places by the same index."""

    def forward(self, x, cu, max_seqlen, window_index):
        torch._check(window_index.shape[0] == x.shape[0])
        q = x.view(x.shape[0], 2, -1)[window_index]
        attended = varlen_attention(q, q, q, cu, max_seqlen)
        return torch.zeros_like(attended).index_copy(0, window_index, attended) + 1


def _scatter_inputs(lengths):
    x, cu, max_seqlen = pack_images(lengths, 8)
    return x, cu, max_seqlen, torch.randperm(x.shape[0])


def test_an_index_that_writes_is_a_scatter_index():
    gm, ctx = trace(ScatterBack(), *_scatter_inputs([5, 7]))
    discover.run(gm, ctx)
    assert "input window_index: scatter_index dims=[0]" in ctx.spec.format().splitlines()


@pytest.fixture(scope="module")
def scattering():
    """``ScatterBack`` compiled with one bucket of 64 rows, after a call that left NaN in its buffers."""
    model = ScatterBack()
    compiled = vgraph_compile.encoder(model, token_budgets=(64,), max_segments=4, compiler="eager")
    poisoned = _scatter_inputs([9, 3])
    with torch.no_grad():
        compiled(torch.full_like(poisoned[0], float("nan")), *poisoned[1:])
    return model, compiled


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_padded_scatter_entries_write_padding_rows_only(scattering, lengths):
    """In the bucket of 64 rows, the padded index entries write padded rows: every call (at most 80 rows) matches
    eager, even after a call that left NaN in the buffers; each call within 64 rows is served by the bucket."""
    model, compiled = scattering
    inputs = _scatter_inputs(lengths)
    fits = sum(lengths) <= 64
    with torch.no_grad(), counters.expect(replays=int(fits), eager_fallbacks=int(not fits)):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_indices_that_place_rows_into_a_longer_dim_are_placement_indices():
    """Patch and CLS rows written by index inputs into patches + images rows: both indices are placement
    indices (shorter than the dim they write by the other's length), and the budgets bound patches + images."""
    model, inputs = placed_cls_vit()
    gm, ctx = trace(model, *inputs)
    discover.run(gm, ctx)
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: cls_rows.shape[0] + patches.shape[0]
group 0: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended', 'attended_1']
input patches: tokens dims=[0]
input cls_rows: placement_index dims=[0]
input patch_rows: placement_index dims=[0]
input cu_seqlens: segment_offsets dims=[0] group=0
input max_seqlen: max_seqlen group=0
inputs: 31 parameters and module state (used in place)""",
    )


class ShiftedPlacement(PlacedClsViT):
    """Writes its CLS rows one row early: padded entries moved by the shift could land on real rows."""

    def forward(self, patches, cu_seqlens, max_seqlen, cls_rows, patch_rows):
        return self.encode_placed(patches, cu_seqlens, max_seqlen, cls_rows - 1, patch_rows)


def test_a_placement_index_shifted_in_the_graph_is_refused():
    model, inputs = placed_cls_vit()
    shifted = ShiftedPlacement(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16)
    gm, ctx = trace(shifted, inputs[0], inputs[1], inputs[2], inputs[3] + 1, inputs[4])
    with pytest.raises(ValueError, match="scatter index 'cls_rows' writes rows of a dim of .* through .*sub"):
        discover.run(gm, ctx)
