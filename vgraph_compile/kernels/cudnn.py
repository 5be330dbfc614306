"""cuDNN's fused attention on ragged (THD) packed rows, through ``nvidia-cudnn-frontend``'s Python graph API
(``pip install nvidia-cudnn-frontend``; CUDA sm80+, fp16/bf16, head_dim a multiple of 8 up to 128: the op pads
other head dims, ``AttentionBackend.head_dims``).

Invariants:
- one cuDNN plan per (device, rows, heads, head_dim, segments, max_seqlen, dtype, scale), built with its
  workspace at the first call, which must be the warm-up before capture; a capture only executes a built plan;
- the ragged offsets (``cu_seqlens * heads * head_dim``) and the segment lengths (``diff(cu_seqlens)``) are
  computed on the device, so a captured graph reads whatever offsets the buffer holds at replay, with no host sync;
- those offsets assume dense rows, so q/k/v views (of a fused qkv output) are made contiguous first;
- zero-length segments (padding that repeats the last offset) are masked out by their length; rows past
  ``cu_seqlens[-1]`` are left unwritten and the op zeroes them.

torch's own ``aten._cudnn_attention_forward`` with ``cum_seq_q`` computes the same thing, but torch 2.11 rebuilds
the cuDNN graph on every call (56-65 ms per call on an H100, whatever the shape) and it cannot be captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


_handles: dict[torch.device, Any] = {}
_plans: dict[tuple, "_Plan"] = {}


@dataclass(frozen=True)
class _Plan:
    graph: Any
    q: Any
    k: Any
    v: Any
    out: Any
    offsets: Any
    lengths: Any
    workspace: torch.Tensor


def _cudnn():
    try:
        import cudnn
    except ImportError as missing:
        raise ImportError(
            "attention_backend='cudnn' needs cuDNN's Python frontend: pip install nvidia-cudnn-frontend"
        ) from missing
    return cudnn


def prepare(device: torch.device) -> None:
    """Load the frontend (a missing package fails here, not in a graph) and create the device's cuDNN handle."""
    cudnn = _cudnn()
    if device not in _handles:
        with torch.cuda.device(device):
            _handles[device] = cudnn.create_handle()


def _build(q: torch.Tensor, segments: int, max_seqlen: int, scale: float) -> _Plan:
    cudnn = _cudnn()
    rows, heads, head_dim = q.shape
    io_type = cudnn.data_type.BFLOAT16 if q.dtype == torch.bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handles[q.device],
    )
    dims = [segments, heads, max_seqlen, head_dim]
    strides = [max_seqlen * heads * head_dim, head_dim, heads * head_dim, 1]
    per_segment = {"dim": [segments + 1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": cudnn.data_type.INT32}
    offsets = graph.tensor(name="ragged_offsets", **per_segment)
    lengths = graph.tensor(name="lengths", **{**per_segment, "dim": [segments, 1, 1, 1]})
    q_t, k_t, v_t = (
        graph.tensor(name=name, dim=dims, stride=strides, data_type=io_type, ragged_offset=offsets)
        for name in ("q", "k", "v")
    )
    out, _ = graph.sdpa(
        name="sdpa",
        q=q_t,
        k=k_t,
        v=v_t,
        generate_stats=False,
        attn_scale=scale,
        use_padding_mask=True,
        seq_len_q=lengths,
        seq_len_kv=lengths,
    )
    out.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(offsets)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=q.device)
    return _Plan(graph, q_t, k_t, v_t, out, offsets, lengths, workspace)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    rows, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    segments = cu_seqlens.shape[0] - 1
    key = (q.device, rows, heads, head_dim, segments, max_seqlen, q.dtype, scale)
    if key not in _plans:
        prepare(q.device)
        _plans[key] = _build(q, segments, max_seqlen, scale)
    plan = _plans[key]
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    offsets = (cu_seqlens * (heads * head_dim)).to(torch.int32).view(-1, 1, 1, 1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32).view(-1, 1, 1, 1)
    handle = _handles[q.device]
    _cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    plan.graph.execute(
        {plan.q: q, plan.k: k, plan.v: v, plan.out: out, plan.offsets: offsets, plan.lengths: lengths},
        plan.workspace,
        handle=handle,
    )
    return out
