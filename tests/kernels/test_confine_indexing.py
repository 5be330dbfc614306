"""The Triton confinement's index arithmetic on the CPU: the element offsets it loads and stores, the segment its
binary search finds, and the tiles covering a row (the kernels themselves are tested in ``tests/gpu``)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.kernels.confine_indexing import (
    CHUNK,
    chunk_width,
    dense,
    element_offsets,
    search_steps,
    segment_of,
)
from vgraph_compile.kernels.segments import cu_seqlens

ROWS, HEADS, HEAD_DIM = 5, 3, 4


def _layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``[rows, heads, head_dim]`` views of a flat base of distinct values, by layout: (base, view)."""
    base = torch.arange(4 * ROWS * HEADS * HEAD_DIM)
    fused = base[: ROWS * 3 * HEADS * HEAD_DIM].view(ROWS, 3, HEADS, HEAD_DIM)
    heads_first = base[: ROWS * HEADS * HEAD_DIM].view(HEADS, ROWS, HEAD_DIM).transpose(0, 1)
    columns_apart = base[: ROWS * HEADS * HEAD_DIM * 2].view(ROWS, HEADS, HEAD_DIM * 2)[:, :, ::2]
    return {
        "contiguous": (base, base[: ROWS * HEADS * HEAD_DIM].view(ROWS, HEADS, HEAD_DIM)),
        "row slice of a fused qkv": (base, fused[:, 1]),
        "heads first": (base, heads_first),
        "every other column": (base, columns_apart),
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_element_offsets_address_each_rows_head_and_column(layout):
    """Entry ``flat`` of a row is ``t[row, flat // head_dim, flat % head_dim]``, in every layout, with the dense
    shortcut wherever ``dense`` allows it."""
    base, t = _layouts()[layout]
    row, flat = torch.arange(ROWS), torch.arange(HEADS * HEAD_DIM)
    offsets = element_offsets(row, flat, *t.stride(), HEAD_DIM, dense(t))
    expected = t[:, flat // HEAD_DIM, flat % HEAD_DIM]
    assert torch.equal(base[t.storage_offset() + offsets], expected)


def test_only_runs_of_adjacent_heads_and_columns_are_dense():
    dense_of = {layout: dense(t) for layout, (_, t) in _layouts().items()}
    assert dense_of == {
        "contiguous": True,
        "row slice of a fused qkv": True,
        "heads first": False,
        "every other column": False,
    }


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=20),
    padding=st.integers(0, 5),
)
def test_binary_search_finds_each_rows_segment(lengths, padding):
    """``search_steps`` halvings find ``searchsorted(cu_seqlens[1:], row, right=True)``: empty segments own no
    row, and padding rows get the segment count."""
    offsets = cu_seqlens(lengths).long()
    rows = torch.arange(sum(lengths) + padding)
    found = segment_of(rows, offsets, len(lengths), search_steps(len(lengths)))
    assert torch.equal(found, torch.searchsorted(offsets[1:], rows, right=True))
    if padding:
        assert found[sum(lengths) :].eq(len(lengths)).all()


@pytest.mark.parametrize("heads, head_dim, chunks", [(16, 72, 9), (16, 80, 10), (1, 8, 1), (3, 12, 1), (2, 100, 2)])
def test_tiles_cover_each_row_in_power_of_two_chunks(heads, head_dim, chunks):
    width = chunk_width(heads, head_dim)
    assert width <= CHUNK and width & (width - 1) == 0
    assert -(-heads * head_dim // width) == chunks
    assert (chunks - 1) * width < heads * head_dim <= chunks * width
