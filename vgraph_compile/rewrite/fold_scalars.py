"""Rewrite: ``.item()`` of a scalar input becomes the value that input had in the trace.

``torch.compile(dynamic=True)`` may pass a module's float attributes (a LayerNorm's ``eps``) as 0-d tensor inputs
that the graph reads with ``.item()``: a host read, which a captured CUDA graph would freeze at its capture-time
buffer contents. Those values are module constants, so the graph takes them as traced.

Invariant: only 0-d inputs (module state or static) whose every use is ``.item()`` are folded; nothing else
changes. The
runtime compares each call's value with the folded one (``folded``): a different value runs eagerly, never with
the old constant.

Before/After::

    item = l_self_modules_norm1_eps.item()
    layer_norm = layer_norm(x, (16,), w, b, item)       layer_norm = layer_norm(x, (16,), w, b, 1e-05)
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from vgraph_compile.counters import counters
from vgraph_compile.spec import PassContext, Role

__all__ = ["run", "folded"]

log = logging.getLogger(__name__)


def _is_item(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"


def folded(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[int, float | int | bool]:
    """Graph input index -> the traced value of each scalar input whose every use is ``.item()``."""
    values = {}
    for node, role in zip(gm.graph.find_nodes(op="placeholder"), ctx.spec.inputs):
        value = ctx.example_inputs[role.index]
        if (
            role.role in (Role.STATIC, Role.PARAMETER)
            and isinstance(value, torch.Tensor)
            and value.dim() == 0
            and node.users
            and all(_is_item(user) for user in node.users)
        ):
            values[role.index] = value.item()
    return values


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    values = folded(gm, ctx)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for index, value in values.items():
        for user in list(placeholders[index].users):
            user.replace_all_uses_with(value)
            gm.graph.erase_node(user)
            counters.nodes_rewritten += 1
    if values:
        log.debug("folded %d scalar inputs to their traced values", len(values))
    return gm
