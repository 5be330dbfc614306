"""The traced graph's inputs (which are module state, what a node is computed from, where each size is read) and
the shapes of its outputs.

Invariant: reads the graph only; every function here answers about inputs or outputs, none gives a role (``roles``,
``groups``) or refuses a graph (``refusals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch
import torch.fx
from torch._dynamo import source as dynamo_source

from vgraph_compile.fx_utils import ancestors, callable_name, example_value
from vgraph_compile.spec import Binding, PassContext, user_name
from vgraph_compile.symbolic import canonical, traced_values

__all__ = [
    "Simplify",
    "simplifier",
    "Inputs",
    "graph_inputs",
    "source_inputs",
    "InputSizes",
    "input_sizes",
    "feature_sizes",
]

Simplify = Callable[[object], sympy.Expr]
"""A size (int, SymInt, sympy expression) in the trace's canonical symbols."""


def simplifier(shape_env) -> Simplify:
    """``Simplify`` with ``shape_env``'s replacements (duck-sized and guarded-equal symbols made one) and its
    divisibility facts (``symbolic.canonical``)."""

    def simplify(value) -> sympy.Expr:
        expr = value.node.expr if isinstance(value, (torch.SymInt, torch.SymFloat)) else sympy.sympify(value)
        return canonical(shape_env, expr)

    return simplify


@dataclass(frozen=True)
class Inputs:
    """The graph's inputs: placeholders in order, and which of them are module state."""

    nodes: tuple[torch.fx.Node, ...]
    parameters: frozenset[int]

    def index(self, node: torch.fx.Node) -> int | None:
        """Position of ``node`` among the inputs; None for any other node."""
        return self.nodes.index(node) if node.op == "placeholder" else None

    def name(self, index: int) -> str:
        return user_name(self.nodes[index].name)


def _module_state(source) -> bool:
    module_sources = (
        dynamo_source.NNModuleSource,
        dynamo_source.UnspecializedNNModuleSource,
        dynamo_source.UnspecializedBuiltinNNModuleSource,
        dynamo_source.ParamBufferSource,
        dynamo_source.UnspecializedParamBufferSource,
    )
    while source is not None:
        if isinstance(source, module_sources):
            return True
        source = getattr(source, "base", None)
    return False


def graph_inputs(gm: torch.fx.GraphModule, ctx: PassContext) -> Inputs:
    """The placeholders of ``gm``; parameters are the module's state (dynamo's sources say which)."""
    nodes = tuple(gm.graph.find_nodes(op="placeholder"))
    parameters = frozenset(
        index
        for index, node in enumerate(nodes)
        if isinstance(ctx.example_inputs[index], torch.nn.Parameter)
        or _module_state(getattr(node, "_dynamo_source", None))
    )
    return Inputs(nodes, parameters)


def source_inputs(start: torch.fx.Node, inputs: Inputs) -> tuple[list[int], bool]:
    """The non-parameter tensor inputs ``start`` is computed from, and whether the path has a cumsum."""
    sources, has_cumsum = [], False
    for node in ancestors(start):
        index = inputs.index(node)
        if index is not None:
            if index not in inputs.parameters and isinstance(example_value(node), torch.Tensor):
                sources.append(index)
        elif node.op in ("call_function", "call_method"):
            has_cumsum |= callable_name(node) == "cumsum"
    return sorted(sources), has_cumsum


@dataclass(frozen=True)
class InputSizes:
    """Result of ``input_sizes``."""

    bindings: tuple[Binding, ...]
    """Where each size symbol is read per call (first place it appears)."""
    shapes: tuple[tuple[sympy.Expr, ...] | None, ...]
    """Per input, its shape (None for ints and constants)."""


def input_sizes(inputs: Inputs, simplify: Simplify) -> InputSizes:
    """Every input's shape, and where each size symbol is read: a dim of a tensor input, or an int input."""
    found: dict[sympy.Symbol, Binding] = {}
    shapes = []
    for index, node in enumerate(inputs.nodes):
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            shapes.append(None)
            expr = simplify(value)
            if isinstance(expr, sympy.Symbol):
                found.setdefault(expr, Binding(expr, index, None))
            continue
        if not isinstance(value, torch.Tensor):
            shapes.append(None)
            continue
        shape = tuple(simplify(size) for size in value.shape)
        shapes.append(shape)
        for dim, size in enumerate(shape):
            if isinstance(size, sympy.Symbol):
                found.setdefault(size, Binding(size, index, dim))
    return InputSizes(tuple(found.values()), tuple(shapes))


def feature_sizes(inputs: Inputs, simplify: Simplify, shape_env) -> dict[sympy.Symbol, int]:
    """Sizes that ``dynamic=True`` made symbolic in the trailing dims of packed inputs (feature widths), at their
    traced values: packed inputs vary in dim 0 only. Bounds later pin them (a call must match them)."""
    leading, trailing = set(), set()
    for index, node in enumerate(inputs.nodes):
        value = example_value(node)
        if index in inputs.parameters or not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            (trailing if dim else leading).update(simplify(size).free_symbols)
    hints = traced_values(shape_env)
    return {symbol: int(hints[symbol]) for symbol in trailing - leading if symbol in hints}


def output_shapes(gm: torch.fx.GraphModule, simplify: Simplify) -> tuple:
    """Per output, its shape (tensors), its value expression (ints), or None."""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    outputs = []
    for arg in values:
        value = example_value(arg) if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.Tensor):
            outputs.append(tuple(simplify(size) for size in value.shape))
        elif isinstance(value, torch.SymInt):
            outputs.append(simplify(value))
        else:
            outputs.append(None)
    return tuple(outputs)
