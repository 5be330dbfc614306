"""FlashAttention-4: the CuTe-DSL varlen forward of ``flash-attn-4`` (``pip install flash-attn-4``, which brings
``nvidia-cutlass-dsl``; CUDA sm90+, fp16/bf16, head_dim a multiple of 8 up to 128, which sm90 and sm100 both run;
the op pads other head dims).

Invariants:
- the first call of a shape JIT-compiles the kernel (seconds, cached per process), so it belongs to the warm-up
  before capture; a capture only launches compiled kernels;
- ``max_seqlen`` is the bucket's host bound, which the kernel takes as the bound of every replay;
- the kernel loads whole key tiles, rows of the next segment or of the padding included, and masks their scores;
  a masked weight times a NaN value is still NaN, so k/v pass through ``segments.confine_nonfinite`` first (as
  for the masked kernels): a NaN/Inf in one segment reaches no other;
- zero-length segments (padding that repeats the last offset) are empty, and rows past ``cu_seqlens[-1]`` are left
  for the op to zero.
"""

from __future__ import annotations

import torch

from vgraph_compile.kernels.segments import confine_nonfinite, segment_ids


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    k, v, spill = confine_nonfinite(k, v, cu_seqlens, segment_ids(cu_seqlens, q.shape[0]))
    out, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
    )
    return out + spill
