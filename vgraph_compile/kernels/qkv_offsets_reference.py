"""CPU reference of FlashInfer's cuDNN batch prefill with packed element offsets, read exactly as the kernel reads
them: sequence ``i`` of q (and k, o) starts at element ``offsets_qko[i]`` of its tensor's storage, of v at element
``offsets_v[i]``; rows step by each tensor's own token stride (v, a view of a fused qkv output, steps by 3x).
Sequence lengths are the differences of the Q/K/O offsets over that token stride. A wrong offset reads wrong
rows, so a mis-padded buffer shows up as wrong output, never as silently right output. Host-synchronising: CPU
reference only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_offsets: torch.Tensor, max_seqlen: int, scale
) -> torch.Tensor:
    half = qkv_offsets.shape[0] // 2
    qko, v_offsets = qkv_offsets[:half].tolist(), qkv_offsets[half:].tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    row = q.stride(0)
    for index in range(half - 1):
        start, length = qko[index] // row, (qko[index + 1] - qko[index]) // row
        v_start = v_offsets[index] // v.stride(0)
        if length < 0 or start + length > q.shape[0] or v_start + length > v.shape[0]:
            raise ValueError(
                f"Q/K/O|V offsets of sequence {index} point outside q/k/v ({qko[index]}..{qko[index + 1]}, v at "
                f"{v_offsets[index]}): the kernel would read out of bounds; pad each half by its own last value"
            )
        if length == 0:
            continue
        rows = slice(start, start + length)
        qs, ks, vs = (t.transpose(0, 1) for t in (q[rows], k[rows], v[v_start : v_start + length]))
        o_start = qko[index] // out.stride(0)
        out[o_start : o_start + length] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out
