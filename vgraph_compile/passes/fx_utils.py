"""Small FX helpers shared by the passes: argument access by schema name, op names, symbolic expressions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
import torch.fx

if TYPE_CHECKING:
    import sympy


def op_name(node: torch.fx.Node) -> str | None:
    """``namespace::name`` of a call to a torch op (packet or overload), else None."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _schema(node: torch.fx.Node) -> torch.FunctionSchema:
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return target._schema


def get_argument(node: torch.fx.Node, name: str) -> Any:
    """The value of schema argument ``name`` in a call node (its default when not passed)."""
    for position, argument in enumerate(_schema(node).arguments):
        if argument.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if position < len(node.args):
                return node.args[position]
            return argument.default_value if argument.has_default_value() else None
    raise KeyError(f"{node.format_node()} has no argument {name!r}")


def set_argument(node: torch.fx.Node, name: str, value: Any) -> None:
    """Set schema argument ``name`` of a call node, positional or keyword as it was passed."""
    for position, argument in enumerate(_schema(node).arguments):
        if argument.name == name:
            if position < len(node.args) and name not in node.kwargs:
                node.update_arg(position, value)
            else:
                node.update_kwarg(name, value)
            return
    raise KeyError(f"{node.format_node()} has no argument {name!r}")


def example_value(node: torch.fx.Node) -> Any:
    """The fake value dynamo recorded for a node (``val`` after AOT)."""
    return node.meta.get("example_value", node.meta.get("val"))


def traced_values(shape_env) -> dict:
    """The value each backed symbol had in the traced call (``backed_var_to_val``; ``var_to_val`` before it)."""
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


def ancestors(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """Every node ``node`` depends on, itself included, each once."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        stack.extend(current.all_input_nodes)


def substitute(expr: "sympy.Expr", values: Mapping["sympy.Symbol", int]) -> "sympy.Expr":
    """``expr`` with each symbol of ``values`` replaced by its integer value (others left symbolic)."""
    import sympy

    return sympy.sympify(expr).xreplace({symbol: sympy.Integer(value) for symbol, value in values.items()})


def evaluate(expr: "sympy.Expr", values: Mapping["sympy.Symbol", int], what: str) -> int:
    """``expr`` at ``values`` as an int; a ValueError naming ``what`` when a symbol is left unassigned."""
    value = substitute(expr, values)
    if not value.is_number:
        raise ValueError(f"{what} is {expr}: {sorted(map(str, value.free_symbols))} have no value")
    return int(value)
