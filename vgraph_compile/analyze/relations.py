"""Relations: sizes the traced graph ties to others, each solved for one symbol as an integer polynomial of the
rest (Qwen2.5-VL's window permutation reshapes ``[n, 4, d]`` into ``[tokens, d]``: tokens = 4 n).

Invariant: reads the graph and the ShapeEnv's guards only; a solution is kept only when it is an integer
polynomial of other symbols, so it can be evaluated at any bucket's sizes.
"""

from __future__ import annotations

from typing import Iterator

import sympy
import torch
import torch.fx

from vgraph_compile.analyze.inputs import Simplify
from vgraph_compile.fx_utils import callable_name, example_value

__all__ = ["relations"]


def _view_equalities(gm: torch.fx.GraphModule, simplify: Simplify) -> Iterator[tuple[sympy.Expr, sympy.Expr]]:
    """(produced size, requested size) of every reshape/view dim the caller gave explicitly."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or callable_name(node) not in ("view", "reshape"):
            continue
        requested = node.args[1:]
        if len(requested) == 1 and isinstance(requested[0], (tuple, list)):
            requested = requested[0]
        produced = example_value(node)
        if not isinstance(produced, torch.Tensor) or len(requested) != produced.dim():
            continue
        for size, want in zip(produced.shape, requested):
            want = example_value(want) if isinstance(want, torch.fx.Node) else want
            if isinstance(want, (int, torch.SymInt)) and not (isinstance(want, int) and want < 0):
                yield simplify(size), simplify(want)


def _integer_polynomial(expr: sympy.Expr) -> bool:
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str)) if expr.free_symbols else None
    except sympy.PolynomialError:
        return False
    return poly is None or all(coefficient.is_Integer for coefficient in poly.coeffs())


def relations(gm: torch.fx.GraphModule, shape_env, simplify: Simplify) -> dict[sympy.Symbol, sympy.Expr]:
    """sizes the graph ties to others, each solved for one symbol as an integer polynomial of the rest.

    Sources: a reshape/view's produced dim equals the one the caller asked for; the ShapeEnv's ``Eq`` guards.
    A compound size equal to a constant (``s // (s // 4) == 4``) is used to simplify the others."""
    equalities = [(lhs, rhs) for lhs, rhs in _view_equalities(gm, simplify) if (lhs - rhs).free_symbols]
    for guard in shape_env.guards:
        expr = simplify(guard.expr)
        if isinstance(expr, sympy.Eq):
            equalities.append((expr.lhs, expr.rhs))
    equalities = list(dict.fromkeys(equalities))
    constants: dict[sympy.Expr, sympy.Expr] = {}
    solved: dict[sympy.Symbol, sympy.Expr] = {}

    def reduce(expr: sympy.Expr) -> sympy.Expr:
        for _ in range(8):
            reduced = sympy.sympify(expr).xreplace(constants).xreplace(solved)
            if reduced == expr:
                break
            expr = reduced
        return expr

    changed = True
    while changed:
        changed = False
        for lhs, rhs in equalities:
            lhs, rhs = reduce(lhs), reduce(rhs)
            if not (lhs - rhs).free_symbols or sympy.simplify(lhs - rhs) == 0:
                continue
            for compound, constant in ((lhs, rhs), (rhs, lhs)):
                if constant.is_Integer and not compound.is_Symbol and compound not in constants:
                    constants[compound] = constant
                    changed = True
                    break
            else:
                for symbol in sorted((lhs - rhs).free_symbols, key=str):
                    try:
                        solutions = sympy.solve(sympy.Eq(lhs, rhs), symbol)
                    except (NotImplementedError, TypeError):
                        continue
                    if len(solutions) == 1 and symbol not in solutions[0].free_symbols:
                        if _integer_polynomial(solutions[0]) and solutions[0].free_symbols:
                            solved[symbol] = solutions[0]
                            solved.update({key: reduce(value) for key, value in solved.items()})
                            changed = True
                            break
    return {symbol: reduce(value) for symbol, value in solved.items()}
