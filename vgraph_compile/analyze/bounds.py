"""Analysis: the static size of every symbol in every bucket, checked against the trace's own guards.

Invariant: never mutates the graph; stores one ``BucketShape`` per budget in ``ctx.buckets``. A call fits a
bucket when each of its sizes is at most the bucket's; every call whose token rows are at most the budget and
whose segments fit the group capacities fits the bucket of that budget (``tests/analyze/test_bounds.py`` proves
it over generated calls).

Symbols covered:
- each attention group's segment symbol: solved from ``segments == capacity``, the capacity being
  ``min(max_segments, budget)``, or with a ``VisionGeometry`` its proven frame bound, or its window bound for the
  groups whose offsets input ``VGraphConfig.window_offsets`` names (with no group named, every group gets the
  larger sizes of both, always safe);
- the token rows ``c + sum(k_i s_i)`` (one symbol, or a sum such as patches + one CLS row per image): each
  ``s_i`` at most ``(budget - c - sum_{j != i} k_j lo_j) / k_i`` with ``lo_j`` the least value of ``s_j`` in a
  call (a segment count: one segment; any other size: 0), and a segment symbol also at most its capacity;
- a symbol the graph ties to others (``spec.relations``, e.g. tokens = 4 n): its relation's value;
- MAX_SEQLEN inputs: the group's bound: ``budget`` (a segment can hold every token), or the geometry's;
- a GATHER_INDEX / SCATTER_INDEX length: the bucket size of the dim it indexes (a permutation is that long,
  padded by identity); a PLACEMENT_INDEX is shorter than the dim it writes: its length is bounded as any size;
- a symbol a guard equates to assigned ones (``Eq(s44, s99)``): that value;
- a size the ShapeEnv pinned to a constant after discovery (``pinned_sizes``: inductor specializing a slice
  length while it compiles): that value in every bucket, and a call must match it (``BucketShape.fixed``);
- feature widths and any other symbol (a dim ``dynamic=True`` made symbolic that nothing ties to the tokens):
  fixed at its traced value, never bounded by a guess; a call with another value fits no bucket (eager).
Every guard dynamo recorded in the ShapeEnv must hold at the bucket's sizes, or the budget is refused
(``BudgetRefused``) with the guard that failed (e.g. a reshape needing a multiple of 4); a trace that pinned the
token count to a constant is refused earlier, by discovery (``check_token_rows``). ``bound_sympy`` gives each
output dim's range.
"""

from __future__ import annotations

import logging

import sympy
import torch.fx
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from vgraph_compile.symbolic import canonical, evaluate, substitute, traced_values
from vgraph_compile.spec import BucketShape, DroppedBucket, PassContext, Role, VarlenSpec

__all__ = [
    "run",
    "BudgetRefused",
    "bucket_shapes",
    "pinned_sizes",
    "solve_for",
    "window_groups",
    "token_caps",
    "output_ranges",
]

log = logging.getLogger(__name__)


class BudgetRefused(ValueError):
    """A budget the trace cannot run at: no call fits it, or it breaks a constraint the trace recorded."""


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


def token_caps(rows: sympy.Expr, budget: int, least: dict[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
    """The largest value of each symbol of ``rows = c + sum(k_i s_i)`` (``k_i > 0``) over the calls with
    ``rows <= budget`` and every ``s_j >= least.get(s_j, 0)``; empty when ``rows`` is a constant."""
    symbols = sorted(rows.free_symbols, key=str)
    poly = sympy.Poly(rows, *symbols) if symbols else None
    coefficients = {symbol: int(poly.coeff_monomial(symbol)) for symbol in symbols}
    constant = int(poly.coeff_monomial(1)) if poly is not None else int(rows)
    floor_rows = constant + sum(k * least.get(symbol, 0) for symbol, k in coefficients.items())
    if floor_rows > budget:
        raise BudgetRefused(
            f"budget {budget} holds no call: the token rows are at least {floor_rows} "
            f"(one segment and no other rows); choose budgets of at least {floor_rows}"
        )
    return {
        symbol: (budget - floor_rows + k * least.get(symbol, 0)) // k for symbol, k in coefficients.items()
    }


def window_groups(ctx: PassContext) -> set[int] | None:
    """Indices of the window-attention groups: those whose offsets input ``config.window_offsets`` names, the
    only group included (a tower whose every block is a window block); None when there are several groups and
    none is named (every group is then sized for frames and windows)."""
    groups, config = ctx.spec.groups, ctx.config
    if config.geometry is None or config.geometry.window_size is None:
        return set()
    named = {name for name in config.window_offsets}
    windows = {group.index for group in groups if ctx.spec.describe_input(group.offsets_input) in named}
    if not windows and len(groups) > 1:
        log.info(
            "no attention group's offsets input is named in window_offsets %s: sizing every group for both "
            "frames and windows (name the window cu_seqlens argument there for tighter buckets)",
            list(config.window_offsets),
        )
        return None
    return windows


def _group_capacity(ctx: PassContext, budget: int, group: int, windows: set[int] | None) -> tuple[int, int]:
    """(segments, max_seqlen) of one attention group in the bucket of ``budget``."""
    config = ctx.config
    if config.geometry is None:
        return min(config.segments, budget), budget
    sizes = config.geometry.bounds(budget, config.max_items, config.max_frames)
    window_count = budget if config.window_bound == "conservative" else sizes.windows
    frames = (sizes.segments, sizes.max_seqlen_full)
    window = (window_count, sizes.max_seqlen_window)
    if windows is None:
        return max(frames[0], window[0]), frames[1]
    return window if group in windows else frames


def _equalities(ctx: PassContext):
    """Each guard dynamo recorded that is an equality, in canonical symbols (with the facts of every guard: sizes
    the guards equate)."""
    for guard in ctx.shape_env.guards:
        expr = canonical(ctx.shape_env, guard.expr)
        if isinstance(expr, sympy.Eq):
            yield expr


def _where(guard) -> str:
    """The user's line that recorded ``guard``, as dynamo located it (empty when it did not)."""
    where = getattr(getattr(guard, "sloc", None), "maybe_user_loc", None)
    return f", recorded at {where}" if where else ""


def _follow_relations(ctx: PassContext, values: dict[sympy.Symbol, int]) -> None:
    """Sizes the graph's relations or the trace's guards pin to assigned ones, until nothing changes."""
    equalities = [(symbol, expr) for symbol, expr in ctx.spec.relations.items()]
    for expr in _equalities(ctx):
        equalities += [(expr.lhs, expr.rhs), (expr.rhs, expr.lhs)]
    changed = True
    while changed:
        changed = False
        for unknown, known in equalities:
            if (
                isinstance(unknown, sympy.Symbol)
                and unknown not in values
                and known.free_symbols
                and known.free_symbols <= set(values)
            ):
                value = substitute(known, values)
                if value.is_Integer:
                    values[unknown] = int(value)
                    changed = True


def _least(spec: VarlenSpec) -> dict[sympy.Symbol, int]:
    """The least value of each segment symbol in a call: the one that makes one segment."""
    least = {}
    for group in spec.groups:
        solved = solve_for(group.segments, 1, f"segment count of group {group.index}")
        if solved is not None:
            least[solved[0]] = solved[1]
    return least


def _symbols(spec: VarlenSpec) -> set[sympy.Symbol]:
    """Every size symbol a call binds: the inputs' symbolic dims and the size ints."""
    symbols = {binding.symbol for binding in spec.bindings}
    for shape in spec.input_shapes:
        for size in shape or ():
            symbols |= size.free_symbols
    return symbols


def pinned_sizes(ctx: PassContext) -> dict[sympy.Symbol, int]:
    """The sizes the trace's ShapeEnv now equates to a constant (a replacement ``s -> 3``). Discovery applies the
    replacements dynamo made, so these are the later ones: inductor specializing a size while it compiles, e.g.
    the length of ``cu_seqlens[1:-1]`` at two images (``cu_seqlens.shape[0] == 3``). Every bucket holds them."""
    pins = {}
    for symbol in _symbols(ctx.spec) | set(ctx.spec.token_rows.free_symbols):
        value = sympy.sympify(ctx.shape_env.replace(symbol))
        if value.is_Integer:
            pins[symbol] = int(value)
    return pins


def _bucket(ctx: PassContext, budget: int, windows: set[int] | None) -> BucketShape:
    spec = ctx.spec
    pinned = pinned_sizes(ctx)
    values: dict[sympy.Symbol, int] = {**spec.features, **pinned}
    max_seqlen = []
    for group in spec.groups:
        capacity, longest = _group_capacity(ctx, budget, group.index, windows)
        solved = solve_for(group.segments, capacity, f"segment count of group {group.index}")
        if solved is not None:
            values.setdefault(*solved)
        max_seqlen.append(longest)
        for index in group.max_seqlen_inputs:
            (symbol,) = [binding.symbol for binding in spec.bindings if binding.input == index]
            values[symbol] = pinned.get(symbol, longest)
    least = {symbol: value for symbol, value in _least(spec).items() if symbol not in pinned}
    for symbol, cap in token_caps(substitute(spec.token_rows, pinned), budget, least).items():
        values[symbol] = min(values.get(symbol, cap), cap)  # a segment symbol: also within the budget
    segments = [evaluate(group.segments, values, f"segment count of group {group.index}") for group in spec.groups]

    _follow_relations(ctx, values)
    for role in spec.inputs:
        if role.indexed is not None and role.role is not Role.PLACEMENT_INDEX:
            length = spec.input_shapes[role.index][0]
            capacity = evaluate(role.indexed, values, f"the dim {role.name} indexes")
            solved = solve_for(length, capacity, f"length of gather index {role.name}")
            if solved is not None:
                values.setdefault(*solved)

    _follow_relations(ctx, values)
    fixed = frozenset(_symbols(spec) - set(values)) | frozenset(spec.features) | frozenset(pinned)
    hints = traced_values(ctx.shape_env)
    for symbol in fixed - set(values):
        values[symbol] = int(hints[symbol])
    for guard in ctx.shape_env.guards:
        expr = sympy.sympify(ctx.shape_env.replace(guard.expr))  # not canonical: its facts come from these guards
        if expr.free_symbols - set(values) - set(ctx.shape_env.replacements):
            continue
        if substitute(expr, values) != sympy.true:
            described = ", ".join(f"{spec.describe(s)}={v}" for s, v in sorted(values.items(), key=str))
            raise BudgetRefused(
                f"budget {budget} breaks the traced constraint {spec.describe_expr(expr)}{_where(guard)} (with "
                f"{described}): the encoder cannot run at that size; pick budgets that satisfy it (e.g. multiples "
                "of the merge size)"
            )
    return BucketShape(budget, values, tuple(segments), tuple(max_seqlen), fixed)


def bucket_shapes(ctx: PassContext, drop_refused: bool = False) -> list[BucketShape]:
    """One bucket per budget, each pinned size (``pinned_sizes``) held at its value. A refused budget raises
    ``BudgetRefused``; with ``drop_refused`` (after the compile, when inductor pinned a size) it is dropped with
    a warning instead, and calls it would serve run in a larger bucket or eagerly."""
    windows = window_groups(ctx)
    shapes = []
    for budget in ctx.config.budgets:
        try:
            shapes.append(_bucket(ctx, budget, windows))
        except BudgetRefused as refused:
            if not drop_refused:
                raise
            ctx.dropped.append(DroppedBucket(budget, f"{refused} (a size inductor pinned while compiling)"))
            log.warning("budget %d dropped: %s", budget, refused)
    return shapes


def output_ranges(spec: VarlenSpec, bucket: BucketShape) -> list[list[ValueRanges]]:
    """Range of every output dim over the calls this bucket serves (``bound_sympy`` over [1, value])."""
    ranges = {symbol: ValueRanges(1, value) for symbol, value in bucket.values.items()}
    return [[bound_sympy(size, ranges) for size in shape] for shape in spec.outputs if isinstance(shape, tuple)]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    ctx.buckets = tuple(bucket_shapes(ctx))
    unrelated = ctx.buckets[0].fixed - set(ctx.spec.features)
    if unrelated:
        log.warning(
            "sizes %s are tied to no budget: pinned at their traced values (other values run eagerly); relate "
            "them to the token count in the encoder, e.g. torch._check(x.shape[0] == tokens)",
            sorted(ctx.spec.describe(symbol) for symbol in unrelated),
        )
    for bucket in ctx.buckets:
        log.debug("%s", bucket.format(ctx.spec))
    return gm
