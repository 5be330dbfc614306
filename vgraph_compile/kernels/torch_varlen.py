"""torch's own varlen FlashAttention-2 (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10, CUDA, fp16/bf16).

``max_seqlen`` is read on the host at launch: inside a captured graph it is the bucket's constant bound, which
sizes the kernel grid (``ceil(max_seqlen / 128)`` blocks per segment and head), so a tight bound matters.
Zero-length segments (padding that repeats the last offset) exit at once.
"""

from __future__ import annotations

import torch


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
