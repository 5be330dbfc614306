"""``vgraph::varlen_attention``: packed variable-length attention as one opaque FX node.

Invariants:
- inputs are ``[tokens, heads, head_dim]`` (any strides), ``cu_seqlens`` is int32 ``[segments + 1]`` on the
  same device, starting at 0 and non-decreasing; ``max_seqlen`` bounds every segment length;
- the output is a fresh contiguous ``[tokens, heads, head_dim]`` tensor whose rows at or past
  ``cu_seqlens[-1]`` are exactly zero, whatever the kernel wrote there;
- no host synchronisation: the op runs inside captured CUDA graphs.
"""

from __future__ import annotations

import torch

from vgraph_compile import backends

__all__ = ["varlen_attention", "VARLEN_ATTENTION"]


@torch.library.custom_op("vgraph::varlen_attention", mutates_args=())
def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of packed ``[tokens, heads, head_dim]`` q/k/v within the segments ``cu_seqlens`` marks.

    ``backend`` names an implementation in ``vgraph_compile.backends`` (``"auto"``: FlashAttention-2 for
    fp16/bf16 on CUDA, the SDPA reference elsewhere). A compiled graph replaces it with the configured one.
    """
    kernel = backends.resolve(backend, q.device, q.dtype).load()
    out = kernel(q, k, v, cu_seqlens, max_seqlen, scale).contiguous()
    rows = torch.arange(q.shape[0], device=q.device, dtype=cu_seqlens.dtype)
    return out.masked_fill_((rows >= cu_seqlens[-1])[:, None, None], 0)


@_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale=None, backend="auto"):
    return q.new_empty(q.shape)


VARLEN_ATTENTION = torch.ops.vgraph.varlen_attention
"""The op packet (graphs hold its ``.default`` overload)."""

varlen_attention = _varlen_attention
