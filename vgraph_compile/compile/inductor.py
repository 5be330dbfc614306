"""Compile once: inductor on the rewritten graph, symbolic in every token and segment size.

Invariant: one compile per trace (``counters.compiles``). The compiled code takes the graph's inputs at any
bucket's sizes, so a bucket costs a capture, never a compile. Inductor's own size decisions (32-bit indexing,
matmul choices, a 0/1 specialization such as ``cu_seqlens[1:-1]`` of length 1) can add guards and replacements
to the trace's ShapeEnv while it lowers. A size it pins to a constant re-derives the buckets with that size held
(``analyze/bounds.pinned_sizes``; dynamo traces calls of other sizes again, as the guard joins its own). Then
each added guard is checked at every bucket's sizes, in the trace's symbols (not through the replacements, which
make a pin's own guard trivially true), and a bucket where one fails is dropped with a warning rather than served
by code that assumed otherwise. A compile that leaves no bucket raises ``BudgetRefused`` naming each budget's
failed guards, inside the call that traced (never an encoder with nothing to serve). ``shape_padding`` is off: its
guards split the budget range, and ``rewrite/align_matmuls`` pads the widths that need it instead. Row reductions
up to ``PERSISTENT_ROW_WIDTH`` columns are persistent (a norm reads its row once), through inductor's own
heuristics handler, for this compile only.

Each class of identical repeated blocks (a ViT's 24-32 blocks) is lowered once and called per block
(``compile/repeated_blocks``, ``compile_blocks_once``); the artifact key is taken on the graph before that
rewrite, which the config and the vgraph sources determine.

The compiled code is saved as an artifact a second process loads instead of compiling (``compile/artifacts``).

The example inputs inductor sees are the trace's fake values: token-sized tensors contiguous (the runtime's
buffers are), parameters at their aligned shapes (``align_matmuls``), sizes as the trace's symbols.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import sympy
import torch
import torch.fx

from vgraph_compile.analyze import bounds
from vgraph_compile.compile import artifacts, repeated_blocks
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value
from vgraph_compile.symbolic import substitute
from vgraph_compile.spec import BucketShape, DroppedBucket, PassContext, Role, guard_origin

if TYPE_CHECKING:
    from vgraph_compile.config import VGraphConfig

__all__ = ["compile_once", "load_compiled", "CompiledFn", "CompileResult"]

log = logging.getLogger(__name__)

CompiledFn = Callable[[list], Sequence[Any]]
"""The compiled graph: takes the list of graph inputs, returns the outputs."""


class CompileResult(NamedTuple):
    run: CompiledFn
    shapes: list[BucketShape]
    """The buckets the compiled code serves."""
    artifact_key: str | None
    """The key of the saved artifact holding the compiled code (None: not on disk, a later process compiles)."""
    guards: tuple[sympy.Expr, ...] | None = None
    """Every size guard of the trace and the compile (``size_guards``): the compiled code runs at any sizes where
    all hold. None when unknown (an artifact saved without them)."""


def size_guards(ctx: PassContext) -> tuple[sympy.Expr, ...]:
    """Every guard in the ShapeEnv, in the symbols the buckets size: any other symbol replaced by what the ShapeEnv
    equates it to (as ``_holds`` does). A guard that replacement decides is a sympy boolean: ``True`` constrains
    nothing and is left out; ``False`` is kept (no size satisfies it)."""
    sized = set().union(*(bucket.values for bucket in ctx.buckets))
    guards = []
    for guard in ctx.shape_env.guards:
        expr = sympy.sympify(guard.expr)
        others = {symbol: ctx.shape_env.replace(symbol) for symbol in expr.free_symbols if symbol not in sized}
        expr = expr.xreplace(others)
        if expr != sympy.true:
            guards.append(expr)
    return tuple(guards)


def load_compiled(config: "VGraphConfig", key: str) -> tuple[CompiledFn, artifacts.Artifact] | None:
    """The compiled code saved under ``key`` in the config's artifact directory, and the artifact (the budgets it
    serves, its size guards); None when absent or unusable."""
    directory = artifacts.artifact_dir(config) if artifacts.available() else None
    loaded = artifacts.load(directory, key) if directory is not None else None
    if loaded is None:
        return None
    counters.artifacts_loaded += 1
    compiled = loaded.compiled
    return (lambda inputs: compiled(*inputs)), loaded


def _parsed_guards(guards: tuple[sympy.Expr, ...] | None, ctx: PassContext) -> tuple[sympy.Expr, ...] | None:
    """Saved guards in this trace's symbols (the same trace names its sizes alike); None when unknown."""
    if guards is None:
        return None
    symbols = {str(symbol): symbol for bucket in ctx.buckets for symbol in bucket.values}
    return tuple(
        guard.xreplace({free: symbols.get(str(free), free) for free in guard.free_symbols}) for guard in guards
    )


def _fake_inputs(gm: torch.fx.GraphModule, ctx: PassContext) -> list[Any]:
    fakes = []
    for node, role in zip(gm.graph.find_nodes(op="placeholder"), ctx.spec.inputs):
        fake = example_value(node)
        if isinstance(fake, torch.Tensor) and role.role is not Role.PARAMETER:
            with fake.fake_mode:
                fake = torch.empty(fake.shape, dtype=fake.dtype, device=fake.device)
        fakes.append(fake)
    return fakes


_INDUCTOR_OPTIONS = {"shape_padding": False, "triton.cudagraphs": False}

PERSISTENT_ROW_WIDTH = 2048
"""Row reductions over at most this many columns run as persistent Triton kernels, each row read once. Inductor's
own limit is 1024: past it, a norm over a ViT's 1152-1536 wide rows (Qwen3-VL, Qwen2-VL, GLM-4.1V) loops over the
row twice, once for its statistics and once to normalize. On an H200 those norm kernels took 34-37 us per layer at
Qwen3-VL's 7,276-row bucket, where reading and writing its rows once is about 67 MB, 14 us at the memory's
bandwidth (``benchmarks/results/roofline_h200_cuda_2026-11-28_first.json``, ``triton_red_fused_*layer_norm``)."""


def _row_reduction_choices():
    """Inductor's heuristics (``InductorChoices``) with persistent row reductions up to ``PERSISTENT_ROW_WIDTH``
    columns; a module-level factory, so inductor's cache key names it (``inductor_choices_class``)."""
    return _persistent_rows_class()()


@functools.cache
def _persistent_rows_class():
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return (
                torch._inductor.config.triton.persistent_reductions
                and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_ROW_WIDTH)
            )

        def uuid(self) -> str:
            return f"vgraph persistent rows <= {PERSISTENT_ROW_WIDTH}"

    return PersistentRows


@contextlib.contextmanager
def _inductor_heuristics() -> Iterator[None]:
    """Inductor's options for one compile, and ``_row_reduction_choices`` as its heuristics: set as this thread's
    handler for the compile only (the user's other compiles keep theirs), and named in the cache key where this
    torch has ``inductor_choices_class``."""
    from torch._inductor.virtualized import V

    options = dict(_INDUCTOR_OPTIONS)
    if hasattr(torch._inductor.config, "inductor_choices_class"):
        options["inductor_choices_class"] = _row_reduction_choices
    with torch._inductor.config.patch(options), V.set_choices_handler(_row_reduction_choices()):
        yield


def _inductor(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[CompiledFn, Any]:
    """The compiled graph, and its saveable ``CompiledArtifact`` (None where this torch has none). With
    ``compile_blocks_once``, ``gm``'s repeated blocks first become calls of shared subgraphs (in place)."""
    from torch._inductor.compile_fx import compile_fx

    if ctx.config.compile_blocks_once:
        gm = repeated_blocks.run(gm)
    with _inductor_heuristics(), torch.no_grad():
        if artifacts.available():
            compiled = torch._inductor.standalone_compile(
                gm, _fake_inputs(gm, ctx), dynamic_shapes="from_tracing_context", options={}
            )
            return (lambda inputs: compiled(*inputs)), compiled
        compiled = compile_fx(gm, _fake_inputs(gm, ctx))
    return (lambda inputs: compiled(*inputs)), None


def _holds(guard: sympy.Expr, bucket: BucketShape, shape_env) -> bool | None:
    """Whether ``guard``, in the trace's symbols, holds at the bucket's sizes; None when it reads sizes the bucket
    does not fix. The bucket's sizes go in as they are, never through the ShapeEnv's replacements: the replacement
    a specialization adds (``s -> 3``) would turn its own guard ``Eq(s, 3)`` into ``3 == 3`` at any bucket. Only a
    symbol the bucket does not size is first replaced by what the ShapeEnv equates it to (a duck-sized one)."""
    guard = sympy.sympify(guard)
    others = {symbol: shape_env.replace(symbol) for symbol in guard.free_symbols if symbol not in bucket.values}
    value = substitute(guard.xreplace(others), bucket.values)
    if value in (sympy.true, sympy.false):
        return bool(value)
    return None


def _added_constraints(shape_env, guards_before: int, replacements_before: dict) -> list[tuple[sympy.Expr, str]]:
    """What inductor assumed while compiling, each with where it came from: the guards it added (their op's line)
    and each new replacement as an equality."""
    added = [(guard.expr, guard_origin(guard)) for guard in shape_env.guards[guards_before:]]
    added += [
        (sympy.Eq(symbol, value), "a size inductor specialized")
        for symbol, value in shape_env.replacements.items()
        if replacements_before.get(symbol) != value
    ]
    return added


def _some_served(shapes: list[BucketShape], ctx: PassContext) -> list[BucketShape]:
    """``shapes``, or a ``BudgetRefused`` naming why each budget was dropped (``ctx.dropped``) and what to do, when
    there is none: no bucket to serve a call from (the trace's build stops here, inside the call that traced)."""
    if shapes:
        return shapes
    reasons = "; ".join(f"budget {dropped.budget}: {dropped.reason}" for dropped in ctx.dropped)
    raise bounds.BudgetRefused(
        f"every token budget {list(ctx.config.budgets)} was dropped, so no bucket serves this encoder: {reasons}. "
        "Choose token_budgets at which these hold. A guard fixing a size at the traced call's value (Eq(1, ...)) "
        "means the call that traced had that size (0 or 1, which inductor specialized): trace on a call with more "
        "than one of it (items, merge units, windows)"
    )


def compile_once(gm: torch.fx.GraphModule, ctx: PassContext) -> CompileResult:
    """The compiled graph, and the buckets it may serve: re-derived with the sizes inductor pinned held at their
    values, and only those where every guard inductor added holds at their sizes. Loaded from a saved artifact when
    one matches (``compile/artifacts``), else compiled, and saved unless inductor pinned a size (a loaded artifact
    would not tell the buckets to hold it). Never returns an empty list of buckets: ``BudgetRefused`` instead, with
    the guards that dropped each budget."""
    if ctx.config.compiler == "eager":
        return CompileResult(lambda inputs: gm(*inputs), _some_served(list(ctx.buckets), ctx), None, size_guards(ctx))
    directory = artifacts.artifact_dir(ctx.config) if artifacts.available() else None
    key = artifacts.artifact_key(gm, ctx) if directory is not None else None
    loaded = load_compiled(ctx.config, key) if key is not None else None
    if loaded is not None:
        run, artifact = loaded
        ctx.dropped.extend(DroppedBucket(budget, reason) for budget, reason in artifact.dropped)
        shapes = [bucket for bucket in ctx.buckets if bucket.budget in artifact.served]
        return CompileResult(run, _some_served(shapes, ctx), key, _parsed_guards(artifact.guards, ctx))
    guards_before, replacements_before = len(ctx.shape_env.guards), dict(ctx.shape_env.replacements)
    pinned_before = bounds.pinned_sizes(ctx)
    start = time.perf_counter()
    compiled, artifact = _inductor(gm, ctx)
    counters.compiles += 1
    added = _added_constraints(ctx.shape_env, guards_before, replacements_before)
    log.info("inductor compiled the encoder once in %.1f s (%d size guards added)", time.perf_counter() - start,
             len(added))  # fmt: skip
    shapes = list(ctx.buckets)
    pinned = bounds.pinned_sizes(ctx)
    if pinned != pinned_before:
        log.info(
            "inductor specialized %s while compiling: the buckets hold those sizes (dynamo traces calls with "
            "other sizes again)",
            ", ".join(f"{ctx.spec.describe(symbol)}={value}" for symbol, value in sorted(pinned.items(), key=str)),
        )
        shapes = bounds.bucket_shapes(ctx, drop_refused=True)
        counters.buckets_dropped += len(ctx.buckets) - len(shapes)
    served, dropped = [], []
    for bucket in shapes:
        failed = [(guard, origin) for guard, origin in added if _holds(guard, bucket, ctx.shape_env) is False]
        if failed:
            reason = "the compiled code assumes " + "; ".join(
                f"{ctx.spec.describe_expr(guard)} (from {origin})" for guard, origin in failed
            ) + ", which fails at that size"
            dropped.append((bucket.budget, reason))
            log.warning("budget %d dropped: %s", bucket.budget, reason)
            counters.buckets_dropped += 1
            continue
        served.append(bucket)
    ctx.dropped.extend(DroppedBucket(budget, reason) for budget, reason in dropped)
    _some_served(served, ctx)
    guards = size_guards(ctx)
    saved = None
    if directory is not None and artifact is not None and pinned == pinned_before:
        budgets = tuple(bucket.budget for bucket in served)
        if artifacts.save(directory, key, artifact, budgets, tuple(map(str, guards)), tuple(dropped)):
            counters.artifacts_saved += 1
            saved = key
    return CompileResult(compiled, served, saved, guards)
