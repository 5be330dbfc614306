"""FlashInfer's cuDNN batch prefill (``flashinfer.prefill.cudnn_batch_prefill_with_kv_cache``) on packed element
offsets ``[Q/K/O offsets | V offsets]`` (CUDA, fp16/bf16; ``pip install flashinfer-python``).

Per-sequence lengths are derived on the device from the Q/K/O offsets. The workspace is allocated once per device
by ``prepare``, when a graph is built: allocated inside the first (warm-up) run it would live in the CUDA graph pool,
untracked. ``max_seqlen`` (the bucket's constant) fixes the cuDNN plan, built at the warm-up run before capture.
"""

from __future__ import annotations

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def _prefill():
    try:
        from flashinfer.prefill import cudnn_batch_prefill_with_kv_cache
    except ImportError as missing:
        raise ImportError(
            "attention_backend='flashinfer' needs FlashInfer with its cuDNN path: pip install flashinfer-python "
            "nvidia-cudnn-frontend"
        ) from missing
    return cudnn_batch_prefill_with_kv_cache


def prepare(device: torch.device) -> None:
    """Load the kernel (a missing package fails here, not in a graph) and allocate the device's workspace."""
    _prefill()
    if device not in _workspaces:
        _workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_offsets: torch.Tensor, max_seqlen: int, scale
) -> torch.Tensor:
    prefill = _prefill()
    half = qkv_offsets.shape[0] // 2
    qko, v_offsets = qkv_offsets[:half], qkv_offsets[half:]
    lengths = ((qko[1:] - qko[:-1]) // q.stride(0)).to(torch.int32).view(-1, 1, 1, 1)
    if q.device not in _workspaces:
        prepare(q.device)
    workspace = _workspaces[q.device]
    out, _ = prefill(
        q,
        k,
        v,
        scale if scale is not None else q.shape[-1] ** -0.5,
        workspace,
        max_token_per_sequence=max_seqlen,
        max_sequence_kv=max_seqlen,
        actual_seq_lens_q=lengths,
        actual_seq_lens_kv=lengths,
        causal=False,
        return_lse=False,
        batch_offsets_q=qko,
        batch_offsets_o=qko,
        batch_offsets_k=qko,
        batch_offsets_v=v_offsets,
        is_cuda_graph_compatible=True,
    )
    return out
