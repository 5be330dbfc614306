"""cuDNN's ragged (THD) attention through torch's own ``aten._cudnn_attention_forward`` with ``cum_seq_q`` /
``cum_seq_k``: the path torch's nested-jagged SDPA takes, so nothing needs installing (CUDA sm80+, fp16/bf16).

Invariants:
- torch derives cuDNN's ragged offsets on the device as ``cu_seqlens * heads * head_dim`` and the segment lengths
  as ``diff(cu_seqlens)``: no host sync, and a captured graph reads whatever offsets the buffer holds at replay;
- those offsets assume dense rows, so q/k/v views (of a fused qkv output) are made contiguous first;
- ``max_seqlen`` (the bucket's host constant) and the segment count fix the cuDNN plan, built at the first call
  (the warm-up before capture); zero-length segments (padding that repeats the last offset) are valid;
- rows past ``cu_seqlens[-1]`` are left unwritten; the op zeroes them.
"""

from __future__ import annotations

import torch

HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128


def check_head_dim(head_dim: int) -> None:
    """cuDNN's fused attention takes head dims that are multiples of 8, up to 128."""
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"attention_backend='cudnn' needs head_dim a multiple of {HEAD_DIM_MULTIPLE} and at most "
            f"{MAX_HEAD_DIM}, got head_dim={head_dim}: pad q/k/v to the next multiple of {HEAD_DIM_MULTIPLE}, or "
            "use attention_backend='torch_varlen'"
        )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    check_head_dim(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, False, 0.0, False, False, scale=scale
    )[0]
