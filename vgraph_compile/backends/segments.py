"""Segment bookkeeping shared by the backends that see the whole packed buffer at once (masked kernels).

A masked kernel still multiplies across segments: a masked score is ``-inf`` only if it was finite before the
mask was added, and a zero attention weight times a NaN or Inf value is NaN. ``confine_nonfinite`` removes both
leaks: the kernel gets k/v with every non-finite entry replaced by 0, which a masked pair then multiplies by an
exact zero weight, and the non-finite values are added back to their own segment's rows only.
"""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Segment index of every row; rows at or past ``cu_seqlens[-1]`` get ``len(cu_seqlens) - 1``, one block of
    their own, so no row is fully masked. Computed on the device (no host synchronisation)."""
    positions = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def confine_nonfinite(
    k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, spill)``: k and v with non-finite entries zeroed, and the ``[rows, heads, head_dim]`` term to add
    to the kernel's output so those values reach their own segment (``ids``, ``segments`` ids in all) and no other.

    Per segment and head, ``spill`` is NaN where the segment's k holds a NaN/Inf (its scores are undefined), else
    the sum of the segment's non-finite v entries per column (NaN, or +-Inf as a positive weight times Inf gives),
    else exactly 0, so the other segments' rows come out bit-identical to a run on clean input.
    """
    bad_keys = ~torch.isfinite(k).all(-1, keepdim=True)
    spill = torch.where(torch.isfinite(v), 0.0, v) + torch.where(bad_keys, float("nan"), 0.0).to(v.dtype)
    per_segment = spill.new_zeros((segments, *spill.shape[1:])).index_add_(0, ids, spill)
    return torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0), per_segment[ids]
