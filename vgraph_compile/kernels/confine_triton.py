"""Triton kernels for ``segments.confine_nonfinite`` and ``segments.mark_poisoned`` on CUDA (imported only there).

Invariants:
- ``confine`` reads k and v once (any strides) and writes contiguous zeroed copies; each program handles a block of
  rows of one head, tests every entry, and for the rows holding a NaN/Inf sets its segment's flag with an atomic
  max of 1 (masked: a clean block issues no atomic, and the result does not depend on the order);
- ``mark`` stores NaN on the rows of poisoned segments only and never reads the output, so a clean call costs the
  flag loads;
- a row's segment is found by a binary search of ``cu_seqlens`` on the device, rows past ``cu_seqlens[-1]`` in the
  extra last slot, empty segments own no row; nothing synchronises with the host, so both run inside captured
  CUDA graphs. The first call of a shape compiles (warm-up, before capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32


@triton.jit
def _segment_of(rows, cu_seqlens, segments, SEARCH_STEPS: tl.constexpr):
    """Number of offsets in ``cu_seqlens[1:]`` at or below each row (``searchsorted(..., right=True)``)."""
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
def _confine_kernel(
    k, v, k_out, v_out, cu_seqlens, poisoned,
    rows, heads, head_dim, segments,
    k_row, k_head, k_col, v_row, v_head, v_col,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(1)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_COLS)
    in_rows = row < rows
    inside = in_rows[:, None] & (col < head_dim)[None, :]
    row64 = row.to(tl.int64)[:, None]
    keys = tl.load(k + row64 * k_row + head * k_head + col[None, :] * k_col, mask=inside, other=0.0)
    values = tl.load(v + row64 * v_row + head * v_head + col[None, :] * v_col, mask=inside, other=0.0)
    keys_finite = tl.abs(keys.to(tl.float32)) < float("inf")
    values_finite = tl.abs(values.to(tl.float32)) < float("inf")
    out = (row64 * heads + head) * head_dim + col[None, :]
    tl.store(k_out + out, tl.where(keys_finite, keys, tl.zeros_like(keys)), mask=inside)
    tl.store(v_out + out, tl.where(values_finite, values, tl.zeros_like(values)), mask=inside)
    broken = (~(keys_finite & values_finite) & inside).to(tl.int32)
    row_broken = (tl.max(broken, axis=1) > 0) & in_rows
    segment = _segment_of(row, cu_seqlens, segments, SEARCH_STEPS)
    flags = poisoned + segment * heads + head
    tl.atomic_max(flags, tl.full([BLOCK_ROWS], 1, tl.int32), mask=row_broken)


@triton.jit
def _mark_kernel(
    out, cu_seqlens, poisoned,
    rows, heads, head_dim, segments,
    out_row, out_head, out_col,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(1)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_COLS)
    in_rows = row < rows
    segment = _segment_of(row, cu_seqlens, segments, SEARCH_STEPS)
    flagged = tl.load(poisoned + segment * heads + head, mask=in_rows, other=0) != 0
    where = (flagged & in_rows)[:, None] & (col < head_dim)[None, :]
    nan = tl.full([BLOCK_ROWS, BLOCK_COLS], float("nan"), tl.float32).to(out.dtype.element_ty)
    offsets = row.to(tl.int64)[:, None] * out_row + head * out_head + col[None, :] * out_col
    tl.store(out + offsets, nan, mask=where)


def _launch_shape(t: torch.Tensor, cu_seqlens: torch.Tensor) -> dict:
    rows, heads, head_dim = t.shape
    segments = cu_seqlens.shape[0] - 1
    return dict(
        grid=(triton.cdiv(rows, BLOCK_ROWS), heads),
        sizes=(rows, heads, head_dim, segments),
        meta=dict(
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=triton.next_power_of_2(head_dim),
            SEARCH_STEPS=max(1, (segments + 1).bit_length()),
        ),
    )


def confine(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``segments.confine_nonfinite`` in one pass over k and v; ``poisoned`` is int32 (1 = poisoned)."""
    launch = _launch_shape(k, cu_seqlens)
    rows, heads, head_dim, segments = launch["sizes"]
    k_out = torch.empty((rows, heads, head_dim), device=k.device, dtype=k.dtype)
    v_out = torch.empty((rows, heads, head_dim), device=v.device, dtype=v.dtype)
    poisoned = torch.zeros((segments + 1, heads), device=k.device, dtype=torch.int32)
    _confine_kernel[launch["grid"]](
        k, v, k_out, v_out, cu_seqlens, poisoned, *launch["sizes"], *k.stride(), *v.stride(), **launch["meta"]
    )
    return k_out, v_out, poisoned


def mark(out: torch.Tensor, cu_seqlens: torch.Tensor, poisoned: torch.Tensor) -> torch.Tensor:
    """``segments.mark_poisoned`` in place on ``out``."""
    launch = _launch_shape(out, cu_seqlens)
    _mark_kernel[launch["grid"]](out, cu_seqlens, poisoned, *launch["sizes"], *out.stride(), **launch["meta"])
    return out
