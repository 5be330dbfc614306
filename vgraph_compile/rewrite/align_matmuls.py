"""Rewrite: matmul widths that break the GPU's alignment are padded with zeros, so dynamic kernels stay fast.

An MLP whose inner width is not a multiple of 8 (Qwen2.5-VL's 3420) makes every ``[tokens, width]`` activation
row misaligned; a static compile pads those matmuls on the fly (``pad_mm``), a dynamic one would add size guards
for it and runs 1.4x slower without. This pass pads the weights instead, once: the producer linears' weight rows
and biases and the consumer linears' weight columns grow to a multiple of ``ALIGNMENT`` with zeros.

Invariant: exact. A padded column of a producer is ``x @ 0 + 0 = 0``; every op between producers and consumers
is pointwise and finite at 0; each consumer multiplies the padded columns by zero weight columns. So the
consumers' outputs, and everything after them, are unchanged. Only the shapes of the region between them grow.

Cases handled (legality, ``_region``): producers ``linear(x, W[n, k], b[n])`` with parameter weights, zero-safe
pointwise ops between them (``act(gate(x)) * up(x)``, ``fc2(gelu(fc1(x)))``), consumers ``linear(h, W[m, n])``
taking the region as their input; each weight used by that linear only. Anything else reading the region (a
reshape, a reduction, an output) refuses the region. Profitability (``should_pad``): on CUDA, when ``n`` is not a
multiple of 16 bytes of the weight's dtype, or whenever ``VGraphConfig.align_matmuls`` is True.

The pass marks each padded parameter's placeholder with ``meta["vgraph.padded_shape"]``; the build pads the
tensors (the pass allocates nothing): a row-padded one owns the module parameter's storage, the parameter a view
of it (``compile/assemble._aligned``).

Before/After (``n = 60`` padded to 64)::

    fc1: "f32[s0, 60]" = linear(x, w1, b1)             fc1: "f32[s0, 64]" = linear(x, w1, b1)
    gelu: "f32[s0, 60]" = gelu(fc1)                    gelu: "f32[s0, 64]" = gelu(fc1)
    fc2: "f32[s0, 16]" = linear(gelu, w2, b2)          fc2: "f32[s0, 16]" = linear(gelu, w2, b2)
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import PassContext, Role

__all__ = ["run", "should_pad", "ALIGNMENT", "PADDED_SHAPE"]

log = logging.getLogger(__name__)

ALIGNMENT = 64
"""Padded widths are multiples of this many elements (a whole tensor-core tile row)."""
PADDED_SHAPE = "vgraph.padded_shape"
"""Placeholder meta key: the shape the build pads that parameter to."""

_LINEAR = {torch._C._nn.linear, F.linear}
_ZERO_SAFE_POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.neg, torch.add, torch.sub, torch.mul, torch.neg,
    torch.sigmoid, torch.tanh, torch.relu, torch.erf, F.gelu, torch._C._nn.gelu, F.silu, F.relu, F.sigmoid,
    F.tanh, torch.nn.functional.mish, "add", "sub", "mul", "neg", "sigmoid", "tanh", "relu",
}  # fmt: skip
"""Pointwise ops that are finite at 0, so padded columns stay finite until zero weights drop them."""


@dataclass(frozen=True)
class _Region:
    width: int
    producers: tuple[torch.fx.Node, ...]
    pointwise: tuple[torch.fx.Node, ...]
    consumers: tuple[torch.fx.Node, ...]


def _linear_args(node: torch.fx.Node) -> tuple | None:
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    return tuple(args[:3])


def _is_pointwise(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _ZERO_SAFE_POINTWISE
    return node.op == "call_function" and node.target in _ZERO_SAFE_POINTWISE


def _private_parameter(node, user: torch.fx.Node, ctx: PassContext, placeholders: dict) -> bool:
    """``node`` is a parameter placeholder that only ``user`` reads."""
    return (
        isinstance(node, torch.fx.Node)
        and node in placeholders
        and ctx.spec.inputs[placeholders[node]].role is Role.PARAMETER
        and set(node.users) == {user}
    )


def _region(start: torch.fx.Node, width: int, ctx: PassContext, placeholders: dict) -> _Region | None:
    """The producers, pointwise ops and consumers connected to ``start``; None when anything else touches them."""
    producers, pointwise, consumers, members = [], [], [], set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in members:
            continue
        members.add(node)
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or value.shape[-1] != width:
            return None
        linear = _linear_args(node)
        if linear is not None:
            _, weight, bias = linear
            if not _private_parameter(weight, node, ctx, placeholders) or not (
                bias is None or _private_parameter(bias, node, ctx, placeholders)
            ):
                return None
            producers.append(node)
        elif _is_pointwise(node):
            pointwise.append(node)
            stack.extend(arg for arg in node.args if isinstance(arg, torch.fx.Node))
            if any(isinstance(arg, torch.fx.Node) for arg in node.kwargs.values()):
                return None
        else:
            return None
        for user in node.users:
            linear = _linear_args(user)
            if linear is not None and linear[0] is node and node not in linear[1:]:
                weight = example_value(linear[1])
                if weight.shape[-1] != width or not _private_parameter(linear[1], user, ctx, placeholders):
                    return None
                consumers.append(user)
            elif _is_pointwise(user):
                stack.append(user)
            else:
                return None
    if not consumers:
        return None
    return _Region(width, tuple(producers), tuple(pointwise), tuple(dict.fromkeys(consumers)))


def should_pad(width: int, weight: torch.Tensor, ctx: PassContext) -> bool:
    """Whether padding ``width`` pays: misaligned for the weight's dtype on CUDA (or forced by the config)."""
    forced = ctx.config.align_matmuls
    if forced is not None:
        return forced and width % ALIGNMENT != 0
    return weight.device.type == "cuda" and width % (16 // weight.element_size()) != 0


def _mark(node: torch.fx.Node, shape: tuple[int, ...]) -> None:
    fake = example_value(node)
    node.meta[PADDED_SHAPE] = shape
    with fake.fake_mode:
        node.meta["example_value"] = torch.zeros(shape, dtype=fake.dtype, device=fake.device)


def _refresh(region: _Region, graph: torch.fx.Graph) -> None:
    """Recompute the fake values of the region's nodes at their padded widths (graph order)."""
    members = set(region.producers + region.pointwise + region.consumers)
    mode = example_value(region.producers[0]).fake_mode
    with mode:
        for node in graph.nodes:
            if node not in members:
                continue
            args = torch.fx.node.map_arg(node.args, example_value)
            kwargs = torch.fx.node.map_arg(node.kwargs, example_value)
            if node.op == "call_method":
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.meta["example_value"] = node.target(*args, **kwargs)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    placeholders = {node: index for index, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    done: set[torch.fx.Node] = set()
    padded = 0
    for node in list(gm.graph.nodes):
        linear = _linear_args(node)
        if linear is None or node in done or not isinstance(linear[1], torch.fx.Node):
            continue
        weight = example_value(linear[1])
        width = weight.shape[0]
        region = _region(node, width, ctx, placeholders)
        if region is None:
            continue
        done.update(region.producers)
        if not should_pad(width, weight, ctx):
            continue
        target = math.ceil(width / ALIGNMENT) * ALIGNMENT
        for producer in region.producers:
            _, weight_node, bias_node = _linear_args(producer)
            _mark(weight_node, (target, example_value(weight_node).shape[1]))
            if bias_node is not None:
                _mark(bias_node, (target,))
        for consumer in region.consumers:
            weight_node = _linear_args(consumer)[1]
            _mark(weight_node, (example_value(weight_node).shape[0], target))
        _refresh(region, gm.graph)
        padded += 1
        log.info("aligned a matmul width %d -> %d (%d producers, %d consumers)", width, target,
                 len(region.producers), len(region.consumers))  # fmt: skip
    counters.nodes_rewritten += padded
    return gm
