"""SDPA with a block-diagonal mask: the reference backend, and the one that runs on the CPU.

Work and mask memory are quadratic in the packed length, so it is meant for correctness and for small inputs.
Rows past ``cu_seqlens[-1]`` form one extra block of their own, so no row is fully masked (a fully masked row
is NaN), and their keys and values are zeroed first: a masked key still enters the matmul, and NaN times a zero
attention weight is NaN, so garbage in padded rows would otherwise poison real rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_ids(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Segment index of every row; rows at or past ``cu_seqlens[-1]`` get ``len(cu_seqlens) - 1``."""
    positions = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    ids = segment_ids(cu_seqlens, q.shape[0])
    mask = ids[:, None] == ids[None, :]
    padded = (ids == cu_seqlens.shape[0] - 1)[:, None, None]
    k, v = k.masked_fill(padded, 0), v.masked_fill(padded, 0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)
