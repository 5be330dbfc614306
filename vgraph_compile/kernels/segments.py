"""Segment bookkeeping: cu_seqlens from lengths, and what the backends that see the whole packed buffer at once
(masked kernels) share.

A masked kernel still multiplies across segments: a masked score is ``-inf`` only if it was finite before the
mask was added, and a zero attention weight times a NaN or Inf value is NaN. ``confine_nonfinite`` removes both
leaks: the kernel gets k/v with every non-finite entry replaced by 0, which a masked pair then multiplies by an
exact zero weight, and the segment that held them gets NaN in that head, on its own rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cu_seqlens", "segment_ids", "confine_nonfinite"]


def cu_seqlens(lengths, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 offsets ``[0, l0, l0 + l1, ...]`` of segments of ``lengths`` (a sequence of ints or a 1-D tensor):
    ``len(lengths) + 1`` entries, the last one the total row count."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def segment_ids(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Segment index of every row; rows at or past ``cu_seqlens[-1]`` get ``len(cu_seqlens) - 1``, one block of
    their own, so no row is fully masked. Computed on the device (no host synchronisation)."""
    positions = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def confine_nonfinite(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, spill)``: k and v with non-finite entries zeroed, and the ``[rows, heads, 1]`` term to add to the
    kernel's output: NaN on every row of a segment whose k or v holds a NaN/Inf in that head, exactly 0 elsewhere
    (``ids``: each row's segment, as ``segment_ids`` gives; the rows past ``cu_seqlens[-1]`` form one more).

    So the other segments' rows come out bit-identical to a run on clean input, and a poisoned segment's head is
    NaN: a NaN never passes, and an Inf is poisoned on purpose even where eager attention would stay finite.
    The per-segment test is a prefix sum over rows of per-row flags: one pass over k and v, no atomics.
    """
    rows = k.shape[0]
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    counts = F.pad(bad.cumsum(0, dtype=torch.int32), (0, 0, 1, 0))
    bounds = F.pad(cu_seqlens, (0, 1), value=rows).long()
    poisoned = (counts[bounds[1:]] - counts[bounds[:-1]]) > 0
    spill = torch.where(poisoned[ids], float("nan"), 0.0).to(v.dtype).unsqueeze(-1)
    return torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0), spill
