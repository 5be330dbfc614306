"""flash-attn's ``flash_attn_varlen_func`` (FA2; ``pip install flash-attn``), CUDA, fp16/bf16.

``max_seqlen`` is the bucket's constant (read on the host at capture). The kernel leaves rows past
``cu_seqlens[-1]`` unwritten; the op zeroes them afterwards, so nothing from the graph pool leaks.
"""

from __future__ import annotations

import torch


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale)
