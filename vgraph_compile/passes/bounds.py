"""Analysis: the static size of every symbol in every bucket, checked against the trace's own guards.

Invariant: never mutates the graph; stores one ``BucketShape`` per budget in ``ctx.buckets``.

Symbols covered:
- the token symbol: solved from ``token_rows == budget``;
- each attention group's segment symbol: solved from ``segments == min(max_segments, budget)``; with a
  ``VisionGeometry``, from its proven frame bound, or its window bound for the window group (the group whose
  traced call had more segments; when the trace cannot tell, both groups get the larger, always safe, sizes);
- MAX_SEQLEN inputs: the group's bound: ``budget`` (a segment can hold every token), or the geometry's;
- a GATHER_INDEX length: the bucket size of the dim it indexes (a permutation is that long, padded by identity);
- a symbol a guard equates to assigned ones (``Eq(s44, s99)``): that value;
- feature widths and any other symbol (a dim ``dynamic=True`` made symbolic that nothing ties to the tokens):
  fixed at its traced value, never bounded by a guess; a call with another value fits no bucket (eager).
Every guard dynamo recorded in the ShapeEnv must hold at the bucket's sizes, or the budget is refused with the
guard that failed (e.g. a reshape needing a multiple of 4). ``bound_sympy`` gives each output dim's range.
"""

from __future__ import annotations

import logging

import sympy
import torch.fx
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from vgraph_compile.passes.fx_utils import traced_values
from vgraph_compile.passes.spec import BucketShape, PassContext

__all__ = ["run", "solve_for", "window_groups"]

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


def window_groups(ctx: PassContext) -> set[int] | None:
    """Indices of the window-attention groups: those whose traced call had more segments than the fewest;
    None when the trace cannot tell frames from windows (several groups with equal counts)."""
    groups = ctx.spec.groups
    if len(groups) == 1 or ctx.config.geometry.window_size is None:
        return set()
    counts = [
        int(group.segments.xreplace({s: sympy.Integer(v) for s, v in traced_values(ctx.shape_env).items()}))
        for group in groups
    ]
    if len(set(counts)) == 1:
        log.info("traced call has equal frame and window counts: sizing every group for both")
        return None
    return {group.index for group, count in zip(groups, counts) if count > min(counts)}


def _group_capacity(ctx: PassContext, budget: int, group: int, windows: set[int] | None) -> tuple[int, int]:
    """(segments, max_seqlen) of one attention group in the bucket of ``budget``."""
    config = ctx.config
    if config.geometry is None:
        return min(config.segments, budget), budget
    sizes = config.geometry.bounds(budget, config.max_items, config.max_frames)
    window_count = budget if config.window_bound == "conservative" else sizes["windows"]
    frames = (sizes["segments"], sizes["max_seqlen_full"])
    window = (window_count, sizes["max_seqlen_window"])
    if windows is None:
        return max(frames[0], window[0]), frames[1]
    return window if group in windows else frames


def _follow_guards(ctx: PassContext, values: dict[sympy.Symbol, int]) -> None:
    """Sizes the trace's guards pin to assigned ones (``Eq(s44, (s59*s99)//1176)``), until nothing changes."""
    changed = True
    while changed:
        changed = False
        for guard in ctx.shape_env.guards:
            expr = sympy.sympify(ctx.shape_env.replace(guard.expr))
            if not isinstance(expr, sympy.Eq):
                continue
            for unknown, known in ((expr.lhs, expr.rhs), (expr.rhs, expr.lhs)):
                if (
                    isinstance(unknown, sympy.Symbol)
                    and unknown not in values
                    and known.free_symbols
                    and known.free_symbols <= set(values)
                ):
                    value = known.xreplace({s: sympy.Integer(v) for s, v in values.items()})
                    if value.is_Integer:
                        values[unknown] = int(value)
                        changed = True


def _bucket(ctx: PassContext, budget: int) -> BucketShape:
    spec = ctx.spec
    values: dict[sympy.Symbol, int] = dict(spec.features)
    solved = solve_for(spec.token_rows, budget, f"token rows for budget {budget}")
    values[solved[0]] = solved[1]
    segments, max_seqlen = [], []
    windows = window_groups(ctx) if ctx.config.geometry is not None else set()
    for group in spec.groups:
        capacity, longest = _group_capacity(ctx, budget, group.index, windows)
        solved = solve_for(group.segments, capacity, f"segment count of group {group.index}")
        if solved is None:
            capacity = int(group.segments)
        else:
            values.setdefault(*solved)
        segments.append(capacity)
        max_seqlen.append(longest)
        for index in group.max_seqlen_inputs:
            (symbol,) = [binding[0] for binding in spec.bindings if binding[1] == index]
            values[symbol] = longest

    _follow_guards(ctx, values)
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
    _follow_guards(ctx, values)
    fixed = frozenset(symbols - set(values)) | frozenset(spec.features)
    hints = traced_values(ctx.shape_env)
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
    return [[bound_sympy(size, ranges) for size in shape] for shape in ctx.spec.outputs if isinstance(shape, tuple)]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    ctx.buckets = tuple(_bucket(ctx, budget) for budget in ctx.config.budgets)
    unrelated = ctx.buckets[0].fixed - set(ctx.spec.features)
    if unrelated:
        log.warning(
            "sizes %s are tied to no budget: pinned at their traced values (other values run eagerly); relate "
            "them to the token count in the encoder, e.g. torch._check(x.shape[0] == tokens)",
            sorted(ctx.spec.describe(symbol) for symbol in unrelated),
        )
    for bucket in ctx.buckets:
        log.debug("%s", bucket.format())
    return gm
