"""FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL; ``pip install flash-attn-4``), CUDA
sm90/sm100, fp16/bf16.

Each (head_dim, dtype, bound) variant is JIT-compiled at its first call, which must be the warm-up before capture.
``max_seqlen`` is the bucket's host constant and must cover every replay. The kernel reads whole tiles past a
segment's end, so padding rows of q/k/v must be finite (the runtime fills them from zeros); rows past
``cu_seqlens[-1]`` are left unwritten and zeroed by the op.
"""

from __future__ import annotations

import torch


def _varlen_func():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as missing:
        raise ImportError(
            "attention_backend='fa4' needs FlashAttention-4: pip install flash-attn-4 (it brings nvidia-cutlass-dsl)"
        ) from missing
    return flash_attn_varlen_func


def prepare(device: torch.device) -> None:
    """Import the kernel when a graph is built, so a broken install fails there and not inside a capture."""
    _varlen_func()


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    out = _varlen_func()(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
    )
    return out[0] if isinstance(out, tuple) else out
