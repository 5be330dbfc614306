"""The varlen-attention ops vgraph knows, and their call sites in a graph: the one place every pass finds them.

Invariant: a node is a site iff it calls an op listed in ``VARLEN_OPS`` (by schema name, packet or overload);
``VarlenOp`` names where that op keeps its arguments, so passes read them by role, never by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch.fx

from vgraph_compile.fx_utils import get_argument, op_name

__all__ = ["VarlenOp", "VARLEN_OPS", "Site", "varlen_sites", "known_ops"]


@dataclass(frozen=True)
class VarlenOp:
    """Where a varlen-attention op keeps its arguments (schema names)."""

    name: str
    """Schema name, ``namespace::name``."""
    q: str
    cu_seqlens: tuple[str, ...]
    max_seqlen: tuple[str, ...]
    backend: str | None = None
    """Argument naming the kernel, rewritten per config (vgraph's own ops only)."""
    qkv_offsets: bool = False
    """Its offsets are FlashInfer's packed ``[Q/K/O | V]`` element offsets (two halves of segments + 1)."""
    lowers_to_qkv_offsets: bool = False
    """``lower_qkv_offsets`` may rewrite it into ``vgraph::qkv_offsets_varlen_attention`` for a packed kernel."""


VARLEN_OPS: dict[str, VarlenOp] = {
    op.name: op
    for op in (
        VarlenOp("vgraph::varlen_attention", "q", ("cu_seqlens",), ("max_seqlen",), "backend", lowers_to_qkv_offsets=True),
        VarlenOp("vgraph::qkv_offsets_varlen_attention", "q", ("qkv_offsets",), ("max_seqlen",), "backend", qkv_offsets=True),
        VarlenOp("torch_attn::_varlen_attn", "query", ("cu_seq_q", "cu_seq_k"), ("max_q", "max_k")),
        VarlenOp(
            "flash_attn::_flash_attn_varlen_forward",
            "q",
            ("cu_seqlens_q", "cu_seqlens_k"),
            ("max_seqlen_q", "max_seqlen_k"),
        ),
    )
}


class Site(NamedTuple):
    """One varlen-attention call: its node and the op's argument layout."""

    node: torch.fx.Node
    op: VarlenOp

    def argument(self, name: str) -> Any:
        """Schema argument ``name`` of this call (its default when not passed)."""
        return get_argument(self.node, name)


def varlen_sites(gm: torch.fx.GraphModule) -> Iterator[Site]:
    """Every varlen-attention call of ``gm``, in graph order."""
    for node in gm.graph.nodes:
        name = op_name(node) if node.op == "call_function" else None
        if name in VARLEN_OPS:
            yield Site(node, VARLEN_OPS[name])


def known_ops() -> str:
    """The ops vgraph recognises, for messages."""
    return ", ".join(VARLEN_OPS)
