"""Sympy helpers over the trace's ShapeEnv symbols: traced values, substitution and evaluation of sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import sympy


def canonical(shape_env, expr) -> "sympy.Expr":
    """``expr`` in the trace's canonical symbols, its floor divisions and modulos reduced by what the ShapeEnv
    knows. Sound wherever every guard of the trace holds (every call the trace serves); works on sizes and on
    guards alike (only those atoms change), so a guard put through it may come out ``True``: check guards at a
    bucket's sizes through the replacements alone (``shape_env.replace``), never through this.

    1. The replacements (duck-sized and guard-equated symbols made one).
    2. The divisibility facts: ``s % c == 0`` (a ``view`` that recorded the tokens a multiple of 4) rewrites each
       floor division or modulo over ``s`` as over ``c * k`` (``k`` a positive integer) when that is simpler:
       ``s // (s // 4)`` is 4 and ``(s + 4) % 4`` is 0, while ``s`` stays ``s``. A fact comes from the ShapeEnv's
       ``divisible`` set, or from an equality guard that every other remainder of ``s`` by ``c`` breaks (a
       ``view(s // 4, 4, d)`` records ``16 s == 64 (s // 4)``, not ``s % 4 == 0``).
    3. An atom the ShapeEnv proves always equals its traced value (``_maybe_evaluate_static`` over its guards:
       ``view(s // 4, -1, d)`` records ``s // (s // 4) == 4``) is that value."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    expr = sympy.sympify(shape_env.replace(sympy.sympify(expr)))
    if not expr.has(FloorDiv, Mod):
        return expr
    expr = _divided(expr, _multiples(shape_env))
    return expr.xreplace(_proven_constants(shape_env, expr))


def _multiples(shape_env) -> dict:
    """``{s: c}`` for each symbol ``s`` the trace's guards make a multiple of ``c > 1`` (``canonical``, step 2)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    multiples = {}
    for fact in shape_env.divisible:
        base, divisor = shape_env.replace(fact).args
        if isinstance(base, sympy.Symbol) and divisor.is_Integer and divisor > 1:
            multiples[base] = int(divisor)
    for guard in shape_env.guards:
        equality = sympy.sympify(shape_env.replace(guard.expr))
        if not isinstance(equality, sympy.Eq):
            continue
        for atom in equality.atoms(FloorDiv, Mod):
            base, divisor = atom.args
            if not (isinstance(base, sympy.Symbol) and divisor.is_Integer and divisor > 1) or base in multiples:
                continue
            quotient = sympy.Dummy("q", integer=True, nonnegative=True)
            remainders = (equality.xreplace({base: divisor * quotient + r}) for r in range(1, int(divisor)))
            if all(holds == sympy.false for holds in remainders):
                multiples[base] = int(divisor)
    return multiples


def _divided(expr: "sympy.Expr", multiples: dict) -> "sympy.Expr":
    """``expr`` with each floor division or modulo over a multiple ``s = c k`` rewritten over ``c k`` where that
    is simpler (``canonical``, step 2)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    quotients = {base: sympy.Dummy(f"{base}_over_{c}", integer=True, positive=True) for base, c in multiples.items()}
    scale = {base: multiples[base] * quotient for base, quotient in quotients.items()}
    unscale = {quotient: FloorDiv(base, multiples[base]) for base, quotient in quotients.items()}

    def divided(atom):
        rewritten = atom.xreplace(scale).xreplace(unscale)
        return rewritten if sympy.count_ops(rewritten) < sympy.count_ops(atom) else atom

    atoms = [atom for atom in expr.atoms(FloorDiv, Mod) if atom.free_symbols & scale.keys()]
    return expr.xreplace({atom: divided(atom) for atom in atoms}) if atoms else expr


def _proven_constants(shape_env, expr: "sympy.Expr") -> dict:
    """Each floor division or modulo of ``expr`` that the ShapeEnv proves equal to its traced value, mapped to it
    (``canonical``, step 3)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    hints = traced_values(shape_env)
    proven = {}
    for atom in expr.atoms(FloorDiv, Mod):
        if not atom.free_symbols <= hints.keys():
            continue
        value = substitute(atom, hints)
        if value.is_Integer and shape_env._maybe_evaluate_static(sympy.Eq(atom, value)) == sympy.true:
            proven[atom] = value
    return proven


def traced_values(shape_env) -> dict:
    """The value each backed symbol had in the traced call (``backed_var_to_val``; ``var_to_val`` before it)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return shape_env.var_to_val if values is None else values


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
