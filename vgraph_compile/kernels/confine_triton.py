"""Triton kernels for ``segments.confine_nonfinite`` and ``segments.finish_output`` on CUDA (imported only there).

Invariants:
- a row's ``heads * head_dim`` entries are addressed as one flat run; where a tensor's heads are ``head_dim`` apart
  and its columns adjacent (contiguous, or a row slice of a fused qkv) that run is contiguous, so loads and stores
  are full-width vector accesses, whatever the row stride;
- ``confine`` reads k and v once and writes contiguous zeroed copies; each program handles a block of rows and one
  chunk of each row. Only a block holding a NaN/Inf searches its rows' segments and sets flags, with atomic maxes
  of 1 (the result does not depend on their order): its segments' flags per head, and the last row of flags (per
  head, "some segment is poisoned") for rows before ``cu_seqlens[-1]``;
- ``finish`` never reads the output: it stores zeros on the rows at or past ``cu_seqlens[-1]`` and, given flags,
  NaN on the rows of poisoned segments in the poisoned heads. A program whose rows all lie before
  ``cu_seqlens[-1]`` loads the "some segment is poisoned" row and, on clean input, stops there;
- a row's segment is found by a binary search of ``cu_seqlens`` on the device, empty segments own no row; nothing
  synchronises with the host, so both run inside captured CUDA graphs. The first call of a shape compiles (warm-up,
  before capture).

The launch parameters come from ``confine_indexing``, whose torch functions compute what ``_offsets`` and
``_segment_of`` compute here (kept equal: a change to one is a change to the other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vgraph_compile.kernels.confine_indexing import chunk_width, dense, search_steps

CONFINE_ROWS = 16
"""Rows per ``confine`` program."""
CONFINE_WARPS = 4
FINISH_ROWS = 64
"""Rows per ``finish`` program (most programs stop after two loads)."""


@triton.jit
def _segment_of(rows, cu_seqlens, segments, SEARCH_STEPS: tl.constexpr):
    """Number of offsets in ``cu_seqlens[1:]`` at or below each row (``searchsorted(..., right=True)``): rows at
    or past ``cu_seqlens[-1]`` get ``segments`` (``confine_indexing.segment_of``)."""
    low = tl.zeros_like(rows)
    high = tl.zeros_like(rows) + segments
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        searching = low < high
        bound = tl.load(cu_seqlens + 1 + middle, mask=searching, other=0)
        right = searching & (bound <= rows)
        low = tl.where(right, middle + 1, low)
        high = tl.where(searching & ~right, middle, high)
    return low


@triton.jit
def _offsets(row, flat, row_stride, head_stride, col_stride, HEAD_DIM: tl.constexpr, DENSE: tl.constexpr):
    """Element offsets of ``[rows, flat entries]``; ``DENSE``: heads ``HEAD_DIM`` apart, columns adjacent
    (``confine_indexing.element_offsets``)."""
    if DENSE:
        within = flat
    else:
        within = (flat // HEAD_DIM) * head_stride + (flat % HEAD_DIM) * col_stride
    return row.to(tl.int64)[:, None] * row_stride + within[None, :]


@triton.jit
def _confine_kernel(
    k, v, k_out, v_out, cu_seqlens, poisoned,
    rows, segments, k_row, k_head, k_col, v_row, v_head, v_col,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, K_DENSE: tl.constexpr, V_DENSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    flat = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    inside = (row < rows)[:, None] & (flat < HEADS * HEAD_DIM)[None, :]
    keys = tl.load(k + _offsets(row, flat, k_row, k_head, k_col, HEAD_DIM, K_DENSE), mask=inside, other=0.0)
    values = tl.load(v + _offsets(row, flat, v_row, v_head, v_col, HEAD_DIM, V_DENSE), mask=inside, other=0.0)
    keys_finite = tl.abs(keys.to(tl.float32)) < float("inf")
    values_finite = tl.abs(values.to(tl.float32)) < float("inf")
    out = row.to(tl.int64)[:, None] * (HEADS * HEAD_DIM) + flat[None, :]
    tl.store(k_out + out, tl.where(keys_finite, keys, tl.zeros_like(keys)), mask=inside)
    tl.store(v_out + out, tl.where(values_finite, values, tl.zeros_like(values)), mask=inside)
    broken = ~(keys_finite & values_finite) & inside
    if tl.max(tl.max(broken.to(tl.int32), axis=1), axis=0) > 0:
        segment = _segment_of(row, cu_seqlens, segments, SEARCH_STEPS)
        in_segment = broken & (segment < segments)[:, None]
        head = (flat // HEAD_DIM)[None, :]
        ones = tl.full([BLOCK_ROWS, CHUNK], 1, tl.int32)
        tl.atomic_max(poisoned + segment[:, None] * HEADS + head, ones, mask=in_segment)
        tl.atomic_max(poisoned + segments * HEADS + head + 0 * segment[:, None], ones, mask=in_segment)


@triton.jit
def _finish_kernel(
    out, cu_seqlens, poisoned,
    rows, segments, out_row, out_head, out_col,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DENSE: tl.constexpr, FLAGGED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, CHUNK: tl.constexpr, HEADS_P2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_ROWS
    end = tl.load(cu_seqlens + segments)
    work = first + BLOCK_ROWS > end
    if FLAGGED:
        head = tl.arange(0, HEADS_P2)
        some = tl.load(poisoned + segments * HEADS + head, mask=head < HEADS, other=0)
        work = work | (tl.max(some, axis=0) > 0)
    if work:
        row = first + tl.arange(0, BLOCK_ROWS)
        padding = (row >= end)[:, None]
        if FLAGGED:
            segment = _segment_of(row, cu_seqlens, segments, SEARCH_STEPS)
        for start in tl.static_range(0, HEADS * HEAD_DIM, CHUNK):
            flat = start + tl.arange(0, CHUNK)
            inside = (row < rows)[:, None] & (flat < HEADS * HEAD_DIM)[None, :]
            value = tl.zeros([BLOCK_ROWS, CHUNK], tl.float32)
            written = padding
            if FLAGGED:
                flags = poisoned + segment[:, None] * HEADS + (flat // HEAD_DIM)[None, :]
                flagged = tl.load(flags, mask=inside & ~padding, other=0) != 0
                value = tl.where(flagged, float("nan"), value)
                written = written | flagged
            offsets = _offsets(row, flat, out_row, out_head, out_col, HEAD_DIM, DENSE)
            tl.store(out + offsets, value.to(out.dtype.element_ty), mask=inside & written)


def confine(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``segments.confine_nonfinite`` in one pass over k and v; ``poisoned`` is int32 (1 = poisoned)."""
    rows, heads, head_dim = k.shape
    segments = cu_seqlens.shape[0] - 1
    k_out = torch.empty((rows, heads, head_dim), device=k.device, dtype=k.dtype)
    v_out = torch.empty((rows, heads, head_dim), device=v.device, dtype=v.dtype)
    poisoned = torch.zeros((segments + 1, heads), device=k.device, dtype=torch.int32)
    chunk = chunk_width(heads, head_dim)
    grid = (triton.cdiv(rows, CONFINE_ROWS), triton.cdiv(heads * head_dim, chunk))
    _confine_kernel[grid](
        k, v, k_out, v_out, cu_seqlens, poisoned, rows, segments, *k.stride(), *v.stride(),
        HEADS=heads, HEAD_DIM=head_dim, K_DENSE=dense(k), V_DENSE=dense(v),
        BLOCK_ROWS=CONFINE_ROWS, CHUNK=chunk, SEARCH_STEPS=search_steps(segments), num_warps=CONFINE_WARPS,
    )  # fmt: skip
    return k_out, v_out, poisoned


def finish(out: torch.Tensor, cu_seqlens: torch.Tensor, poisoned: torch.Tensor | None) -> torch.Tensor:
    """``segments.finish_output`` in place on ``out``."""
    rows, heads, head_dim = out.shape
    segments = cu_seqlens.shape[0] - 1
    _finish_kernel[(triton.cdiv(rows, FINISH_ROWS),)](
        out, cu_seqlens, cu_seqlens if poisoned is None else poisoned, rows, segments, *out.stride(),
        HEADS=heads, HEAD_DIM=head_dim, DENSE=dense(out), FLAGGED=poisoned is not None,
        BLOCK_ROWS=FINISH_ROWS, CHUNK=chunk_width(heads, head_dim),
        HEADS_P2=triton.next_power_of_2(heads), SEARCH_STEPS=search_steps(segments),
    )  # fmt: skip
    return out
