"""Sympy helpers over the trace's ShapeEnv symbols: traced values, substitution and evaluation of sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import sympy


def canonical(shape_env, expr) -> "sympy.Expr":
    """``expr`` in the trace's canonical symbols: the ShapeEnv's replacements applied (duck-sized and
    guard-equated symbols made one), then its divisibility facts. A fact ``s % c == 0`` (a ``view`` that proved
    the tokens a multiple of 4) rewrites each floor division or modulo over ``s`` as over ``c * k`` (``k`` a
    positive integer) when that is simpler: ``s // (s // 4)`` is 4 and ``(s + 4) % 4`` is 0, while ``s`` stays
    ``s``. Works on sizes and on guards alike (only those atoms change)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    expr = sympy.sympify(shape_env.replace(sympy.sympify(expr)))
    if not expr.has(FloorDiv, Mod):
        return expr
    multiples = {}
    for fact in shape_env.divisible:
        base, divisor = shape_env.replace(fact).args
        if isinstance(base, sympy.Symbol) and divisor.is_Integer and divisor > 1:
            multiples[base] = (divisor, sympy.Dummy(f"{base}_over_{divisor}", integer=True, positive=True))
    scale = {base: divisor * quotient for base, (divisor, quotient) in multiples.items()}
    unscale = {quotient: FloorDiv(base, divisor) for base, (divisor, quotient) in multiples.items()}

    def divided(atom):
        rewritten = atom.xreplace(scale).xreplace(unscale)
        return rewritten if sympy.count_ops(rewritten) < sympy.count_ops(atom) else atom

    atoms = [atom for atom in expr.atoms(FloorDiv, Mod) if atom.free_symbols & scale.keys()]
    return expr.xreplace({atom: divided(atom) for atom in atoms}) if atoms else expr


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
