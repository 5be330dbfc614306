"""Sympy helpers over the trace's ShapeEnv symbols: traced values, substitution and evaluation of sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import sympy


def traced_values(shape_env) -> dict:
    """The value each backed symbol had in the traced call (``backed_var_to_val``; ``var_to_val`` before it)."""
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


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
