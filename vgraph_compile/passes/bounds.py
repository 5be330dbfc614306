"""Analysis: the static size of every symbol in every bucket, checked against the trace's own guards.

Invariant: never mutates the graph; stores one ``BucketShape`` per budget in ``ctx.buckets``.

Symbols covered:
- the token symbol: solved from ``token_rows == budget``;
- each attention group's segment symbol: solved from ``segments == min(max_segments, budget)``;
- MAX_SEQLEN inputs: the group's bound, ``budget`` (a segment can hold every token);
- a GATHER_INDEX length: the bucket size of the dim it indexes (a permutation is that long, padded by identity);
- any other symbol (a dim ``dynamic=True`` made symbolic that nothing ties to the tokens): fixed at its traced
  value, never bounded by a guess; a call with another value fits no bucket and runs eagerly.
Every guard dynamo recorded in the ShapeEnv must hold at the bucket's sizes, or the budget is refused with the
guard that failed (e.g. a reshape needing a multiple of 4). ``bound_sympy`` gives each output dim's range.
"""

from __future__ import annotations

import logging

import sympy
import torch.fx
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from vgraph_compile.passes.spec import BucketShape, PassContext

__all__ = ["run", "solve_for"]

log = logging.getLogger(__name__)


def solve_for(expr: sympy.Expr, target: int, what: str) -> tuple[sympy.Symbol, int] | None:
    """The (symbol, integer value) making ``expr == target``; None when ``expr`` is constant."""
    free = sorted(expr.free_symbols, key=str)
    if not free:
        return None
    if len(free) > 1:
        raise ValueError(f"{what} is {expr}: vgraph can bound a size of one dynamic symbol only")
    (symbol,) = free
    solutions = [s for s in sympy.solve(sympy.Eq(expr, target), symbol) if s.is_integer and s > 0]
    if not solutions:
        raise ValueError(f"{what} is {expr}, which never equals {target}: choose a budget it can reach")
    return symbol, int(min(solutions))


def _bucket(ctx: PassContext, budget: int) -> BucketShape:
    spec = ctx.spec
    values: dict[sympy.Symbol, int] = {}
    solved = solve_for(spec.token_rows, budget, f"token rows for budget {budget}")
    values[solved[0]] = solved[1]
    segments, max_seqlen = [], []
    for group in spec.groups:
        capacity = min(ctx.config.segments, budget)
        solved = solve_for(group.segments, capacity, f"segment count of group {group.index}")
        if solved is None:
            capacity = int(group.segments)
        else:
            values.setdefault(*solved)
        segments.append(capacity)
        max_seqlen.append(budget)
        for index in group.max_seqlen_inputs:
            (symbol,) = [binding[0] for binding in spec.bindings if binding[1] == index]
            values[symbol] = budget

    for role in spec.inputs:
        if role.indexed is not None:
            length = spec.input_shapes[role.index][0]
            capacity = int(role.indexed.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
            solved = solve_for(length, capacity, f"length of gather index {role.name}")
            if solved is not None:
                values.setdefault(*solved)

    symbols = set()
    for shape in spec.input_shapes:
        for size in shape or ():
            symbols |= size.free_symbols
    symbols |= {binding[0] for binding in spec.bindings}
    fixed = frozenset(symbols - set(values))
    hints = getattr(ctx.shape_env, "backed_var_to_val", None) or ctx.shape_env.var_to_val
    for symbol in fixed:
        values[symbol] = int(hints[symbol])
    substitution = {symbol: sympy.Integer(value) for symbol, value in values.items()}
    for guard in ctx.shape_env.guards:
        expr = sympy.sympify(ctx.shape_env.replace(guard.expr))
        if expr.free_symbols - set(substitution) - set(ctx.shape_env.replacements):
            continue
        if expr.xreplace(substitution) != sympy.true:
            raise ValueError(
                f"budget {budget} breaks the traced constraint {guard.expr} (with {values}): the encoder "
                "cannot run at that size; pick budgets that satisfy it (e.g. multiples of the merge size)"
            )
    return BucketShape(budget, values, tuple(segments), tuple(max_seqlen), fixed)


def output_ranges(ctx: PassContext, bucket: BucketShape) -> list[list[ValueRanges]]:
    """Range of every output dim over the calls this bucket serves (``bound_sympy`` over [1, value])."""
    ranges = {symbol: ValueRanges(1, value) for symbol, value in bucket.values.items()}
    return [
        [bound_sympy(size, ranges) for size in shape]
        for shape in ctx.spec.outputs
        if isinstance(shape, tuple)
    ]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    ctx.buckets = tuple(_bucket(ctx, budget) for budget in ctx.config.budgets)
    for bucket in ctx.buckets:
        log.debug("%s", bucket.format())
    return gm
