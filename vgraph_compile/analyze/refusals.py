"""Refusals of what vgraph cannot serve, each in the user's names: a value read on the host inside the graph,
tokens of another dtype than the parameters they meet, and a token row count that is not a sum of sizes.

Invariant: raises or returns None; changes nothing. A token count the trace fixed raises ``StaticTokensError``
(the backend runs such a trace eagerly and says how to get a dynamic one).
"""

from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from vgraph_compile.analyze.inputs import Inputs
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import InputRole, Role, StaticTokensError, VarlenSpec

__all__ = ["check_no_host_sync", "check_token_dtypes", "check_token_rows"]


def check_no_host_sync(gm: torch.fx.GraphModule) -> None:
    """No node may produce a data-dependent value (``.item()``/``.tolist()`` would sync the host in a graph)."""
    for node in gm.graph.nodes:
        value = example_value(node)
        unbacked = free_unbacked_symbols(value) if value is not None else set()
        if unbacked:
            raise ValueError(
                f"node {node.format_node()}{_source_line(node)} produces a data-dependent value "
                f"{sorted(map(str, unbacked))} "
                "(e.g. .item(), .tolist(), nonzero): a CUDA graph cannot read device data on the host. "
                "Compute it on the host and pass it to the encoder as an input (Python int or tensor)."
            )


def _source_line(node: torch.fx.Node) -> str:
    """`` at file:line (code)``: the user's line that made ``node`` (the innermost frame dynamo recorded), or ""."""
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    places = [(place, code) for place, code in zip(frames, frames[1:]) if place.startswith("File ")]
    if not places:
        return ""
    place, code = places[-1]
    path, _, rest = place[len('File "'):].partition('", line ')
    return f" at {path.rsplit('/site-packages/', 1)[-1]}:{rest.split(',')[0]} ({code})"


def check_token_dtypes(gm: torch.fx.GraphModule, inputs: Inputs, roles: dict[int, InputRole]) -> None:
    """Tokens must have the floating dtype of the parameters they first meet (a matmul would fail after compile)."""
    parameters = {inputs.nodes[index] for index in inputs.parameters}
    for index, role in roles.items():
        value = example_value(inputs.nodes[index])
        if role.role is not Role.TOKENS or not isinstance(value, torch.Tensor):
            continue
        for user in inputs.nodes[index].users:
            met = [
                example_value(arg)
                for arg in user.all_input_nodes
                if arg in parameters and isinstance(example_value(arg), torch.Tensor) and example_value(arg).dim() > 1
            ]
            for parameter in met:
                if parameter.dtype.is_floating_point and parameter.dtype != value.dtype:
                    name = inputs.name(index)
                    raise ValueError(
                        f"input {name!r} is {value.dtype} but meets parameters of {parameter.dtype} in "
                        f"{user.format_node()}: pass {name}.to({parameter.dtype}) (or cast the encoder)"
                    )


def _tie_hint(rows: sympy.Expr, spec_names: Callable[[sympy.Symbol], str], hints: dict) -> str:
    """The ``torch._check`` line tying two sizes of ``rows``, with the ratio they had in the traced call."""
    symbols = sorted(rows.free_symbols, key=lambda symbol: -int(hints.get(symbol, 0)))
    if len(symbols) >= 2 and all(symbol in hints for symbol in symbols[:2]):
        big, small = symbols[:2]
        ratio = int(hints[big]) // max(int(hints[small]), 1)
        if ratio * int(hints[small]) == int(hints[big]):
            factor = "" if ratio == 1 else f"{ratio} * "
            return f"torch._check({spec_names(big)} == {factor}{spec_names(small)})"
    names = " and ".join(spec_names(symbol) for symbol in symbols)
    return f"torch._check(...) relating {names}"


def check_token_rows(spec: VarlenSpec, hints: dict) -> None:
    """the token rows (first site, relations applied) must be a constant plus positive multiples of
    sizes; refused in the user's names otherwise."""
    rows = spec.token_rows
    if not rows.free_symbols:
        fixed = _fixed_dims(spec)
        raise StaticTokensError(
            f"the trace fixed the attention's packed row count at {rows}"
            f"{' (with ' + ', '.join(fixed) + ')' if fixed else ''}: without dynamic=True, or with duck sizing (a "
            "first call with a size equal to another one, such as as many merge units as the patch width) or a "
            "first call of one token, dynamo specializes it. Use vgraph_compile.encoder, which traces with neither."
        )
    poly = None
    try:
        poly = sympy.Poly(rows, *sorted(rows.free_symbols, key=str))
    except sympy.PolynomialError:
        pass
    if (
        poly is None
        or poly.total_degree() != 1
        or any(
            not coefficient.is_Integer or (any(monomial) and coefficient <= 0) for monomial, coefficient in poly.terms()
        )
    ):
        pinned = _fixed_dims(spec, (0, 1))
        if pinned:
            raise StaticTokensError(
                f"the attention's packed row count is {spec.describe_expr(rows)}, not a sum of sizes, because the "
                f"trace fixed {', '.join(pinned)} (dynamo specializes sizes 0 and 1): it serves such calls only. "
                "Use vgraph_compile.encoder, which traces without that specialization."
            )
        raise ValueError(
            f"the attention's packed row count is {spec.describe_expr(rows)}: vgraph bounds a sum of sizes (e.g. "
            "patches + one CLS row per image), and found no relation in the graph that reduces it to one. "
            f"Tie the sizes in the encoder before the attention, e.g. {_tie_hint(rows, spec.describe, hints)}"
        )


def _fixed_dims(spec: VarlenSpec, sizes: tuple[int, ...] | None = None) -> list[str]:
    """Leading dims of non-parameter tensor inputs that the trace fixed (at one of ``sizes``; None: at any)."""
    return [
        f"{spec.describe_input(role.index)}.shape[0] == {shape[0]}"
        for role, shape in zip(spec.inputs, spec.input_shapes)
        if role.role is not Role.PARAMETER and shape and shape[0].is_Integer
        and (sizes is None or shape[0] in sizes)
    ]
