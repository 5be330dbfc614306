import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile

from tests.helpers import trace
from vgraph_compile.counters import counters
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
