"""Segment bookkeeping: cu_seqlens from lengths, and what the backends whose kernels read across segment edges
(masked kernels, and FA4's key tiles) share.

A masked kernel still multiplies across segments: a masked score is ``-inf`` only if it was finite before the
mask was added, and a zero attention weight times a NaN or Inf value is NaN. Confinement removes both leaks in two
steps around the kernel:

- ``confine_nonfinite`` gives the kernel k/v with every non-finite entry replaced by 0, which a masked pair then
  multiplies by an exact zero weight, and flags ``[segments + 1, heads]``: row ``i < segments`` nonzero where
  segment ``i``'s k or v holds a NaN/Inf in that head, the last row nonzero where some segment's does (rows past
  ``cu_seqlens[-1]`` are never flagged: they come out zero);
- ``finish_output`` (the epilogue) writes NaN into the kernel's output on every row of a poisoned segment, in that
  head only, and zeros on the rows past ``cu_seqlens[-1]``.

So the other segments' rows come out bit-identical to a run on clean input, a poisoned segment's head is NaN (a NaN
never passes, and an Inf is poisoned on purpose even where eager attention would stay finite), and padding rows are
exactly zero. Without flags, ``finish_output`` is the op's zeroing of padding rows for every kernel.

On CUDA both steps are Triton kernels (``confine_triton``): one pass that reads k and v once and writes their
zeroed copies, and an epilogue that stores on the padding rows and the poisoned rows only (it does not read the
output; on clean input it touches the padding rows alone). Elsewhere, or without Triton, the torch functions below
run; they are also the reference the Triton kernels are tested against. Neither synchronises with the host.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["cu_seqlens", "segment_ids", "confine_nonfinite", "finish_output", "confined"]


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


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _fused(t: torch.Tensor) -> bool:
    return t.is_cuda and t.shape[0] > 0 and _triton_installed()


def confine_nonfinite(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, poisoned)``: k and v with non-finite entries zeroed (fresh tensors; the inputs are not changed),
    and ``[segments + 1, heads]`` flags: row ``i < segments`` nonzero where segment ``i``'s k or v holds a NaN/Inf
    in that head, the last row where some segment's does (rows past ``cu_seqlens[-1]`` are not flagged)."""
    if _fused(k):
        from vgraph_compile.kernels import confine_triton

        return confine_triton.confine(k, v, cu_seqlens)
    return confine_nonfinite_reference(k, v, cu_seqlens)


def finish_output(
    out: torch.Tensor, cu_seqlens: torch.Tensor, poisoned: torch.Tensor | None = None
) -> torch.Tensor:
    """``out`` (``[rows, heads, head_dim]``, a fresh kernel output) with zeros on the rows at or past
    ``cu_seqlens[-1]`` and, given ``poisoned`` flags (``confine_nonfinite``'s), NaN on every row of a segment
    flagged in that head; every other entry is unchanged, bit for bit. On CUDA ``out`` is written in place and
    returned."""
    if _fused(out):
        from vgraph_compile.kernels import confine_triton

        return confine_triton.finish(out, cu_seqlens, poisoned)
    return finish_output_reference(out, cu_seqlens, poisoned)


def confine_nonfinite_reference(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``confine_nonfinite`` in torch ops: per-row flags, then a prefix sum over rows gives each segment's count
    of non-finite rows per head (no atomics)."""
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    counts = F.pad(bad.cumsum(0, dtype=torch.int32), (0, 0, 1, 0))
    bounds = cu_seqlens.long()
    per_segment = (counts[bounds[1:]] - counts[bounds[:-1]]) > 0
    poisoned = torch.cat([per_segment, per_segment.any(0, keepdim=True)])
    return torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0), poisoned


def finish_output_reference(
    out: torch.Tensor, cu_seqlens: torch.Tensor, poisoned: torch.Tensor | None = None
) -> torch.Tensor:
    """``finish_output`` in torch ops (out of place)."""
    ids = segment_ids(cu_seqlens, out.shape[0])
    if poisoned is not None:
        rows_poisoned = F.pad(poisoned.bool()[:-1], (0, 0, 0, 1))[ids]
        out = out.masked_fill(rows_poisoned.unsqueeze(-1), float("nan"))
    return out.masked_fill((ids == cu_seqlens.shape[0] - 1)[:, None, None], 0)


def confined(kernel: Callable[..., torch.Tensor], queries: bool = False) -> Callable[..., torch.Tensor]:
    """``kernel`` (an ``attention(q, k, v, cu_seqlens, max_seqlen, scale)`` that reads across segment edges)
    given confined k/v, its output marked NaN on the poisoned segments' heads and zero past ``cu_seqlens[-1]``.
    ``queries``: q is confined too (its non-finite entries zeroed, their segments poisoned), for a kernel whose
    output rows can read other rows' queries."""

    @functools.wraps(kernel)
    def attention(q, k, v, cu_seqlens, max_seqlen, scale):
        k, v, poisoned = confine_nonfinite(k, v, cu_seqlens)
        if queries:
            q, _, poisoned_queries = confine_nonfinite(q, q, cu_seqlens)
            poisoned = poisoned | poisoned_queries
        return finish_output(kernel(q, k, v, cu_seqlens, max_seqlen, scale), cu_seqlens, poisoned)

    return attention
