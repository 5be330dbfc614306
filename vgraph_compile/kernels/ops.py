"""``vgraph::varlen_attention``: packed variable-length attention as one opaque FX node.

Invariants:
- inputs are ``[tokens, heads, head_dim]`` (any strides), ``cu_seqlens`` is int32 ``[segments + 1]`` on the
  same device, starting at 0 and non-decreasing; ``max_seqlen`` bounds every segment length;
- the output is a fresh contiguous ``[tokens, heads, head_dim]`` tensor whose rows at or past
  ``cu_seqlens[-1]`` are exactly zero, whatever the kernel wrote there;
- no host synchronisation: the op runs inside captured CUDA graphs;
- with ``sequence_ranks > 1`` (set by the ``sequence_attention`` rewrite, never by a model) q/k/v are this rank's
  slice of rows and ``cu_seqlens`` the whole sequence's: ``kernels/sequence.py`` states that layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import finish_output
from vgraph_compile.kernels.sequence import sequence_attention

__all__ = ["varlen_attention", "VARLEN_ATTENTION", "qkv_offsets_varlen_attention", "PACKED_VARLEN_ATTENTION"]


@torch.library.custom_op("vgraph::varlen_attention", mutates_args=())
def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    backend: str = "default",
    sequence_group: str = "",
    sequence_ranks: int = 1,
) -> torch.Tensor:
    """Attention of packed ``[tokens, heads, head_dim]`` q/k/v within the segments ``cu_seqlens`` marks.

    ``backend`` names an implementation in ``vgraph_compile.kernels`` (``"default"``: FlashAttention-2 for
    fp16/bf16 on CUDA, the SDPA reference elsewhere), or one per row count and one-segment calls
    (``registry.by_rows``), chosen here from q's rows and the offsets' segment count, both shapes read on the host
    (inside a captured graph they are the bucket's; at a call's exact sizes, the call's own). A compiled graph
    replaces it with the configured one.
    ``sequence_group`` / ``sequence_ranks``: the process group (by name) whose ranks each hold a slice of the rows;
    the compiled graphs of a sequence-parallel tower set them (``rewrite/sequence_attention``).
    """
    resolved = registry.resolve(backend, q.device, q.dtype, rows=q.shape[0], segments=cu_seqlens.shape[0] - 1)
    if resolved.qkv_offsets:
        raise ValueError(
            f"backend {backend!r} reads packed [Q/K/O | V] offsets: call qkv_offsets_varlen_attention, or compile with "
            "vgraph, whose lower_qkv_offsets pass builds them"
        )

    def attend(q, k, v, cu_seqlens, max_seqlen):
        out = _at_supported_head_dim(resolved, q, k, v, cu_seqlens, max_seqlen, scale).contiguous()
        return out if resolved.confined else finish_output(out, cu_seqlens)

    if sequence_ranks > 1:  # its all-to-all returns rows by rank: laid out again as the fake kernel promises
        return sequence_attention(attend, q, k, v, cu_seqlens, sequence_group, sequence_ranks).contiguous()
    return attend(q, k, v, cu_seqlens, max_seqlen)


def _at_supported_head_dim(backend, q, k, v, cu_seqlens, max_seqlen, scale):
    """The kernel's output at q's head_dim: q/k/v zero-padded to a head_dim the kernel runs, if it needs one, and
    the output sliced back. Exact: zero columns add nothing to q.k, the padded output columns are dropped, and the
    scale is the original head_dim's."""
    kernel, head_dim = backend.load(), q.shape[-1]
    width = backend.padded_head_dim(head_dim)
    if width == head_dim:
        return kernel(q, k, v, cu_seqlens, max_seqlen, scale)
    q, k, v = (F.pad(t, (0, width - head_dim)) for t in (q, k, v))
    return kernel(q, k, v, cu_seqlens, max_seqlen, head_dim**-0.5 if scale is None else scale)[..., :head_dim]


@_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale=None, backend="default", sequence_group="", sequence_ranks=1):
    return q.new_empty(q.shape)


VARLEN_ATTENTION = torch.ops.vgraph.varlen_attention
"""The op packet (graphs hold its ``.default`` overload)."""

def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, **options: Any
) -> torch.Tensor:
    """``vgraph::varlen_attention`` (see ``_varlen_attention``: ``options`` are its ``scale``, ``backend``,
    ``sequence_group`` and ``sequence_ranks``), with a ``ValueError`` naming ``cu_seqlens`` when it is no tensor
    (a Python list of offsets), in eager code and in a trace alike. The options pass on as keywords, so a traced
    graph holds the op as the caller wrote it."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            f"varlen_attention: cu_seqlens must be a 1-D int32 tensor of segment offsets, got a "
            f"{type(cu_seqlens).__name__}; pass torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)"
        )
    return _varlen_attention(q, k, v, cu_seqlens, max_seqlen, **options)


@torch.library.custom_op("vgraph::qkv_offsets_varlen_attention", mutates_args=())
def qkv_offsets_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_offsets: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    backend: str = "qkv_offsets_reference",
) -> torch.Tensor:
    """Varlen attention on FlashInfer's packed element offsets: int32 ``[Q/K/O offsets | V offsets]``, each half
    ``segments + 1`` long and padded with its own last value.

    q and k rows must be contiguous (``heads * head_dim`` apart), like the output, so one half serves all three;
    v may be a strided view (of a fused qkv output), its offsets counted in its own stride. Rows past the last
    Q/K/O offset come out zero.
    """
    row = q.shape[1] * q.shape[2]
    dense_rows = all(
        (t.shape[0] <= 1 or t.stride(0) == row) and t.stride(1) == t.shape[2] and t.stride(2) == 1 for t in (q, k)
    )
    if not dense_rows:
        raise ValueError(
            f"Q/K/O|V offsets share one Q/K/O half: q and k need contiguous rows (strides {q.stride()} and "
            f"{k.stride()}); pass q.contiguous() and k.contiguous()"
        )
    kernel = registry.resolve(backend, q.device, q.dtype).load()
    out = kernel(q, k, v, qkv_offsets, max_seqlen, scale).contiguous()
    end = qkv_offsets[qkv_offsets.shape[0] // 2 - 1] // row
    rows = torch.arange(q.shape[0], device=q.device, dtype=qkv_offsets.dtype)
    return out.masked_fill_((rows >= end)[:, None, None], 0)


@qkv_offsets_varlen_attention.register_fake
def _(q, k, v, qkv_offsets, max_seqlen, scale=None, backend="qkv_offsets_reference"):
    return q.new_empty(q.shape)


PACKED_VARLEN_ATTENTION = torch.ops.vgraph.qkv_offsets_varlen_attention
