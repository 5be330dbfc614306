import torch
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile

from tests.helpers import trace
from vgraph_compile.models.packed_vit import pack_images
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


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_padded_scatter_entries_write_padding_rows_only(lengths):
    """In a bucket of 64 rows, the padded index entries write padded rows: every real row matches eager, even
    after a call that left NaN in the buffers."""
    inputs = _scatter_inputs(lengths)
    with torch.no_grad():
        torch.testing.assert_close(SCATTERING(*inputs), ScatterBack()(*inputs), rtol=1e-5, atol=1e-5)


SCATTERING = vgraph_compile.encoder(ScatterBack(), token_budgets=(64,), max_segments=4, compiler="eager")
with torch.no_grad():
    _nan = _scatter_inputs([9, 3])
    SCATTERING(torch.full_like(_nan[0], float("nan")), *_nan[1:])
