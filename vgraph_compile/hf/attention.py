"""Routing a Hugging Face vision tower's attention through ``vgraph_compile.varlen_attention``.

The Qwen towers take their packed ``cu_seqlens`` branch only for attention implementations whose name contains
"flash"; every other implementation splits q/k/v with ``cu_seqlens.tolist()`` (a host sync in every layer). So
an attention function is registered under a flash name, and ``routed_attention(tower)`` selects it for the
duration of a call, leaving the tower's own setting in place outside it. transformers' code is not edited.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Iterator

import torch

from vgraph_compile.kernels.ops import varlen_attention

__all__ = ["ATTENTION_NAME", "routed_attention", "routed_config", "vgraph_flash_attention"]

ATTENTION_NAME = "vgraph_flash_varlen"
"""Registered with transformers' ``AttentionInterface``; contains "flash" so the towers pass cu_seqlens."""


def vgraph_flash_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``[1, heads, tokens, head_dim]`` in (keys and values may have fewer heads,
    each serving a group of queries), ``[1, tokens, heads, head_dim]`` out."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(
            f"{type(module).__name__} called the vgraph attention without cu_seqlens/max_seqlen: it serves "
            "packed vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), whose flash branch passes both"
        )
    if dropout:
        raise ValueError("vgraph attention is inference-only: put the tower in eval() mode (dropout must be 0)")
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves a group of queries
        groups = query.shape[1] // key.shape[1]
        key, value = (tensor.repeat_interleave(groups, dim=1) for tensor in (key, value))
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    # A tower that computes its offsets from a grid_thw on the host (the stock code accepts one) hands them over
    # there; the kernel reads them where q is. Traced graphs get theirs on the device and copy nothing.
    cu_seqlens = cu_seq_lens_q.to(q.device, non_blocking=True)
    return varlen_attention(q, k, v, cu_seqlens, max_length_q, scale=scaling).unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, vgraph_flash_attention)


_routing_lock = threading.Lock()
_routed: dict[int, tuple[int, str]] = {}
"""id of a config routed now -> (how many blocks route it, its own setting): nested and concurrent blocks over
one config restore its own setting when the last one leaves."""


@contextlib.contextmanager
def routed_attention(tower: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``tower`` (all its blocks share one config) attends through vgraph's op."""
    _register()
    config = tower.config
    with _routing_lock:
        count, previous = _routed.get(id(config), (0, config._attn_implementation))
        config._attn_implementation = ATTENTION_NAME
        _routed[id(config)] = (count + 1, previous)
    try:
        yield tower
    finally:
        with _routing_lock:
            count, previous = _routed.pop(id(config))
            if count > 1:
                _routed[id(config)] = (count - 1, previous)
            else:
                config._attn_implementation = previous


def routed_config(config):
    """A shallow copy of a tower's ``config`` that selects vgraph's op; ``config`` itself is unchanged."""
    _register()
    routed = copy.copy(config)
    routed._attn_implementation = ATTENTION_NAME
    return routed
