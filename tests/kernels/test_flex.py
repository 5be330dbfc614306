"""The FlexAttention backend on the CPU: equality with the float64 per-segment reference, the device-built
document BlockMask tile for tile against ``create_block_mask``, and a whole-graph trace that is not retraced when
only the offsets change."""

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from tests.helpers import segment_reference
from tests.kernels.test_segments import check_isolation, poisoned_calls
from vgraph_compile.kernels import flex
from vgraph_compile.kernels.segments import cu_seqlens, segment_ids
from vgraph_compile.kernels.ops import varlen_attention

# Lengths around the 128-row tile: segments inside one tile, across tiles, empty, and a last partial tile.
lengths_around_tiles = st.lists(st.sampled_from([0, 1, 5, 127, 128, 129]) | st.integers(0, 300), min_size=1, max_size=5)


def _offsets(lengths):
    return cu_seqlens(lengths)


@given(lengths=lengths_around_tiles, padding=st.integers(0, 140), scale=st.sampled_from([None, 0.3]))
def test_flex_matches_per_segment_reference(lengths, padding, scale):
    """Real rows equal per-segment attention; rows past the last offset are exactly zero, even when NaN."""
    rows = max(sum(lengths) + padding, 1)
    q, k, v = (torch.randn(rows, 2, 8) for _ in range(3))
    cu = _offsets(lengths)
    for t in (q, k, v):
        t[int(cu[-1]) :] = float("nan")
    out = varlen_attention(q, k, v, cu, max(max(lengths), 1), scale=scale, backend="flex")
    end = int(cu[-1])
    torch.testing.assert_close(out[:end].double(), segment_reference(q, k, v, cu, scale)[:end], rtol=1e-5, atol=1e-5)
    assert out[end:].eq(0).all()


def _tiles(block_mask) -> tuple[list[set[int]], list[set[int]]]:
    """Per query tile, the sets of partial and of full key tiles."""

    def sets(count, indices):
        return [set(indices[0, 0, row, : count[0, 0, row]].tolist()) for row in range(count.shape[-1])]

    return (
        sets(block_mask.kv_num_blocks, block_mask.kv_indices),
        sets(block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    )


@given(lengths=lengths_around_tiles, padding=st.integers(0, 140))
def test_document_mask_tiles_equal_create_block_mask(lengths, padding):
    """The O(tiles^2) classification from each tile's first and last segment id gives the tiles that evaluating
    the mask on every element gives: the same partial and the same full tiles per query tile."""
    rows = max(sum(lengths) + padding, 1)
    ids = segment_ids(_offsets(lengths), rows)
    expected = create_block_mask(lambda b, h, q, kv: ids[q] == ids[kv], None, None, rows, rows, device="cpu")
    assert _tiles(flex.document_mask(ids)) == _tiles(expected)


def test_compiled_kernel_takes_each_calls_mask_without_retracing():
    """The CUDA path: a BlockMask built per call from the offsets goes into one compiled ``flex_attention``; new
    offsets of the same shape reuse its graph. ``aot_eager``: the CPU flex template of torch 2.11-2.13 cannot lower
    this ``mask_mod``."""
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention, fullgraph=True, backend="aot_eager")
    q, k, v = (torch.randn(300, 2, 8) for _ in range(3))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lengths in ([5, 0, 125, 1, 159], [1, 1, 1, 296, 1], [0, 0, 300, 0, 0]):
        cu, end = _offsets(lengths), sum(lengths)
        out, expected = flex._attend(q, k, v, cu, None, compiled)[:end], segment_reference(q, k, v, cu)[:end]
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames + 1


def test_flex_runs_inside_a_fullgraph_compile():
    """The op in a ``torch.compile(fullgraph=True)`` function gives the eager op's result (the compiled graph
    calls it below autograd, where eager flex's ``vmap`` needs functorch's dispatch keys re-admitted)."""
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    cu = _offsets([13, 0, 27])

    def attend(q, k, v, cu):
        return varlen_attention(q * 2, k, v, cu, 27, backend="flex") + 1

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, cu), attend(q, k, v, cu))


@settings(max_examples=25, deadline=None)
@given(call=poisoned_calls())
@example(call=([1, 1], 0, 1, 0, 0, float("nan")))  # a NaN query of segment 1 reached segment 0 before q was confined
def test_bf16_nonfinite_query_key_or_value_stays_in_its_segment(call):
    """In bf16 flex spreads a NaN query entry to other rows of its head; confined queries keep it in its segment.
    Padded as the GPU test pads (4 segments, 600 rows)."""
    lengths, padding, *poison = call
    lengths = lengths + [0] * (4 - len(lengths))
    check_isolation("flex", (lengths, 600 - sum(lengths), *poison), torch.bfloat16, "cpu", dict(rtol=2e-2, atol=2e-2))
