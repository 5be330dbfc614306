"""Small FX helpers shared by every stage: argument access by schema name, op names, example values, and the one
wrapper every pass runs through (``apply_pass``)."""

from __future__ import annotations

import logging
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.fx

if TYPE_CHECKING:
    from vgraph_compile.spec import PassContext

log = logging.getLogger(__name__)


def op_name(node: torch.fx.Node) -> str | None:
    """``namespace::name`` of a call to a torch op (packet or overload), else None."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def callable_name(node: torch.fx.Node) -> str:
    """The name a call node calls, however it was spelled: ``cumsum`` for ``x.cumsum``, ``torch.cumsum`` and
    ``aten.cumsum.default`` alike; ``add`` for ``operator.add``."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0]
    return getattr(target, "__name__", str(target))


_IN_PLACE_OPERATORS = frozenset({"iadd", "imul", "isub", "itruediv", "iand", "ior"})
"""In-place operators (``x += y``) besides the ``*_`` methods."""


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether a call writes into its first argument: an ``add_``-style method or function, or an in-place operator
    (``x += y``); ``and_``/``or_`` are the operator module's plain ``&`` and ``|``."""
    name = callable_name(node)
    return (name.endswith("_") and node.target not in (operator.and_, operator.or_)) or name in _IN_PLACE_OPERATORS


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


Pass = Callable[[torch.fx.GraphModule, "PassContext"], torch.fx.GraphModule]
"""A pass: ``run(gm, ctx) -> gm``."""


def apply_pass(name: str, pass_: Pass, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Run one pass: timed, graph logged before/after at debug level, then linted and recompiled."""
    debug = log.isEnabledFor(logging.DEBUG)
    if debug:
        log.debug("%s: before\n%s", name, gm.print_readable(print_output=False))
    start = time.perf_counter()
    gm = pass_(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    log.debug("%s took %.1f ms", name, 1e3 * (time.perf_counter() - start))
    if debug:
        log.debug("%s: after\n%s", name, gm.print_readable(print_output=False))
    return gm
