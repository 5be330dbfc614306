"""SDPA with a block-diagonal mask: the reference backend, and the one that runs on the CPU.

Work and mask memory are quadratic in the packed length, so it is meant for correctness and for small inputs.
Rows past ``cu_seqlens[-1]`` form one extra block of their own, so no row is fully masked (a fully masked row
is NaN). Segments are isolated exactly, NaN and Inf included: the kernel sees k/v with non-finite entries zeroed,
so masked pairs contribute exact zeros, and the segment that held them comes out NaN in that head
(``segments.confined``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vgraph_compile.kernels.segments import confined, segment_ids


def unconfined(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    """The masked kernel alone: a NaN/Inf in k or v reaches other segments."""
    ids = segment_ids(cu_seqlens, q.shape[0])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=ids[:, None] == ids[None, :], scale=scale
    )
    return out.transpose(0, 1)


attention = confined(unconfined)
