"""Sequence-parallel varlen attention: each rank holds a slice of the packed rows, attention spans all of them.

Layout (the contract with ``hf/parallel/sequence_parallel``): every rank of the group holds ``rows`` local rows (its
bucket's size, the same on every rank), of which the first ``slice_rows`` are its slice of the packed sequence;
rank ``r``'s slice is packed rows ``[r * slice_rows, (r + 1) * slice_rows)``, the last rank's padded to that size.
``cu_seqlens`` are the segments of the whole packed sequence, padding included (they end at
``ranks * slice_rows``), the same tensor on every rank; so ``slice_rows = cu_seqlens[-1] // ranks`` is read on the
device, with no host sync.

Head-parallel all-to-all (DeepSpeed-Ulysses): heads are zero-padded to a multiple of the ranks; q, k and v are laid
out together (one copy) and one all-to-all gives each rank every rank's rows of all three for its share of the heads,
one index gather packs them in sequence order (the rows past each rank's slice dropped), the kernel attends within
the segments on strided views of the three, the inverse gather puts the rows back per rank, and a second
all-to-all returns each rank its own rows with every head: two collectives and two gathers per site, whatever the
tensors (on two H200s, Qwen3-VL's q, k and v each in a collective of their own and gathered apart cost 5.5 of a
24 ms call at 1x1344^2). Local rows past ``slice_rows`` come out zero. Both collectives are
``torch.ops._c10d_functional`` ones on the group's name, so they run inside captured CUDA graphs with NCCL (and on
gloo for CPU tests).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["sequence_attention"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(q, k, v, cu_seqlens, max_seqlen) -> out``: packed varlen attention on one process, rows past the last offset
zero."""


def _all_to_all(chunks: torch.Tensor, group_name: str) -> torch.Tensor:
    """``chunks[j]`` goes to rank ``j``; the result's ``[i]`` came from rank ``i``."""
    ranks = chunks.shape[0]
    flat = chunks.reshape(chunks.shape[0] * chunks.shape[1], -1)
    splits = [chunks.shape[1]] * ranks
    received = torch.ops._c10d_functional.all_to_all_single(flat, splits, splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(received).view(chunks.shape)


def sequence_attention(
    attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, group_name: str,
    ranks: int,
) -> torch.Tensor:
    """Attention of this rank's ``[rows, heads, head_dim]`` q/k/v over the whole sequence (module docstring)."""
    rows, heads, head_dim = q.shape
    share = -(-heads // ranks)
    padded = share * ranks

    def by_rank(tensor: torch.Tensor) -> torch.Tensor:
        """[rows, heads, d] of this rank -> [ranks, rows, share, d] (a view where no head is padded)."""
        tensor = F.pad(tensor, (0, 0, 0, padded - heads)) if padded != heads else tensor
        return tensor.reshape(rows, ranks, share, head_dim).transpose(0, 1)

    qkv = _all_to_all(torch.stack([by_rank(t) for t in (q, k, v)], dim=2), group_name)  # [ranks, rows, 3, share, d]
    positions = torch.arange(ranks * rows, device=q.device)
    slice_rows = (cu_seqlens[-1].to(positions.dtype) // ranks).clamp(1, rows)
    in_slice = positions < ranks * slice_rows
    packed_from = torch.where(in_slice, positions // slice_rows * rows + positions % slice_rows, positions)
    packed = qkv.view(ranks * rows, 3, share, head_dim).index_select(0, packed_from)
    out = attend(packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens, ranks * rows)
    local = positions % rows
    kept = local < slice_rows
    unpacked_from = torch.where(kept, positions // rows * slice_rows + local, 0)
    back = out.index_select(0, unpacked_from).masked_fill_(~kept[:, None, None], 0)
    mine = _all_to_all(back.view(ranks, rows, share, head_dim), group_name)
    return mine.permute(1, 0, 2, 3).reshape(rows, padded, head_dim)[:, :heads]
