"""The index arithmetic of the Triton confinement (``confine_triton``), in plain Python and torch.

The launch parameters (``dense``, ``search_steps``, ``chunk_width``) are what ``confine_triton`` passes to its
kernels. ``element_offsets`` and ``segment_of`` compute, with torch ops on the CPU, what the kernels'
``_offsets`` and ``_segment_of`` compute per program, step for step, so the arithmetic is tested without a GPU
(``tests/kernels/test_confine_indexing.py``); the kernels against the torch confinement are in ``tests/gpu``.

Invariants:
- ``element_offsets`` addresses entry ``flat`` of row ``row`` as ``t[row, flat // head_dim, flat % head_dim]``,
  and where ``dense`` holds the flat index alone is that entry's offset in the row;
- ``segment_of`` with ``search_steps(segments)`` halvings equals ``searchsorted(cu_seqlens[1:], row,
  right=True)``: empty segments own no row, rows at or past ``cu_seqlens[-1]`` get ``segments``.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "chunk_width", "dense", "element_offsets", "search_steps", "segment_of"]

CHUNK = 128
"""Flat entries of a row per tile column (a row of 16 heads of 72 is 9 chunks, of 80 is 10)."""


def dense(t: torch.Tensor) -> bool:
    """Whether each row's ``heads * head_dim`` entries of ``t`` (``[rows, heads, head_dim]``) are one contiguous
    run: heads ``head_dim`` apart, columns adjacent (contiguous, or a row slice of a fused qkv)."""
    heads, head_dim = t.shape[1:]
    return (heads <= 1 or t.stride(1) == head_dim) and (head_dim <= 1 or t.stride(2) == 1)


def search_steps(segments: int) -> int:
    """Halvings of the binary search over ``segments + 1`` outcomes (a segment, or past the end)."""
    return max(1, (segments + 1).bit_length())


def chunk_width(heads: int, head_dim: int) -> int:
    """Flat entries per tile column: ``CHUNK``, or the power of two covering a narrower row."""
    return min(CHUNK, 1 << (heads * head_dim - 1).bit_length())


def element_offsets(
    row: torch.Tensor, flat: torch.Tensor, row_stride: int, head_stride: int, col_stride: int, head_dim: int,
    is_dense: bool,
) -> torch.Tensor:  # fmt: skip
    """Element offsets of ``[rows, flat entries]``, as the kernels' ``_offsets``."""
    within = flat if is_dense else (flat // head_dim) * head_stride + (flat % head_dim) * col_stride
    return row.to(torch.int64)[:, None] * row_stride + within[None, :]


def segment_of(rows: torch.Tensor, cu_seqlens: torch.Tensor, segments: int, steps: int) -> torch.Tensor:
    """Number of offsets in ``cu_seqlens[1:]`` at or below each row, by ``steps`` halvings, as the kernels'
    ``_segment_of`` (a lane whose search has ended loads nothing)."""
    low = torch.zeros_like(rows)
    high = torch.zeros_like(rows) + segments
    for _ in range(steps):
        middle = (low + high) // 2
        searching = low < high
        bound = torch.where(searching, cu_seqlens[(1 + middle).clamp(max=segments)], 0)
        right = searching & (bound <= rows)
        low = torch.where(right, middle + 1, low)
        high = torch.where(searching & ~right, middle, high)
    return low
