"""``VGraphRuntime``: serves the calls of one traced encoder from the buckets its build made.

Per call: read the real sizes from the inputs, validate them (before anything runs), choose the smallest bucket
that holds every size, then, holding the runtime's lock: fill the bucket's buffers by each input's padding rule
(a keyed call's metadata by one copy of the bytes staged at its key's first call), replay (or run) the bucket,
narrow the outputs to the real sizes and copy them out. A later call of a key under ``smallest_bucket`` is a
straight line: its token inputs checked against the key's first replay, whose plan, bucket and fill views it reuses.
A call no bucket holds runs the traced graph eagerly, counted and logged once per reason; so does a call that needs
autograd (the buckets are inference-only).

Under ``smallest_bucket`` and ``measured`` alike, a call runs the compiled code at its exact sizes instead (where
its size guards allow) when its padding rows would cost more than that code's host launch can lose
(``call_costs.PaddingCosts``, measured at warm-up on CUDA: large calls pay no padding), or when it holds one segment
in an attention group whose measured kernels give one segment of its rows another kernel than its bucket's (a
dense kernel for one large image: ``rewrite/kernel_choice``).

With ``call_choice="measured"``, the warm-up also times every bucket's replay and the compiled code at its sizes
without a graph (``serve/call_costs``), and a call that fits a bucket takes the cheapest of: padding it to the
smallest bucket (a replay), splitting it at a segment boundary over two smaller buckets (where
``serve/split.can_split`` allows; the offsets are read only when the table says a split could win), running the
compiled code at the call's exact sizes with no graph (no padding, no replay: where every size guard of the trace
and the compile holds at those sizes), and, when the caller passes it (``stock``), the user's own module. The
stock module is timed on real calls: the first two calls of a bucket that the caller lets it serve run it (the
second timed: the first pays the stock code's cold start), and so does a later call whose rows are more than a
quarter away from every call timed there; its time for a call is the nearest timed call's, scaled by rows. A call
is not sent to the stock module to be timed where a timed stock call of no more rows (in any bucket: the stock
work grows with the rows) already took longer than the call's cheapest other choice: a tower whose stock code is
slow pays its timing once, not once per size. ``stats_table()`` counts each choice.

Captures (``VGraphConfig.captures``): by default the first call starts a thread that captures the buckets' graphs
largest first, one at a time holding the lock, and calls run in the pause between two captures; a call whose
bucket is not captured yet runs the compiled code at its exact sizes (or on the bucket's buffers, without a graph,
where a size guard fails there). ``warmup()`` captures what is left itself and returns once every graph is captured
and the padding costs are measured. Over a process group whose graphs hold collectives, and under sequence
parallelism, the first call captures every bucket before it is served.

Concurrency: the lock covers fill to copy-out, so callers on several threads never see each other's rows. On
CUDA the lock is released once the work is queued, not finished. Calls on one stream are ordered by it; a call on
another stream than the previous call's first waits for everything queued on that stream so far (its copy-out
included) before its fill, so callers on different streams are ordered too, and a single-stream caller pays for no
event. The returned tensors are fresh and safe to read on the caller's stream.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

import sympy
import torch

from vgraph_compile.compile.assemble import CompiledEncoder
from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.kernels import registry
from vgraph_compile.serve.call_costs import (
    CallCosts,
    PaddingCosts,
    measure_call_costs,
    load_padding_costs,
    measure_padding_costs,
    save_padding_costs,
    median_ms,
)
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.spec import BucketShape
from vgraph_compile.serve import fills
from vgraph_compile.serve.call_checks import CallChecks, CallPlan
from vgraph_compile.serve.split import Splitter, can_split
from vgraph_compile.symbolic import evaluate, substitute

__all__ = ["VGraphRuntime"]

log = logging.getLogger(__name__)

_SERIALS = itertools.count(1)

_CAPTURING: "weakref.WeakSet[VGraphRuntime]" = weakref.WeakSet()
"""Runtimes whose captures thread was started: stopped at exit, so no capture is cut off by the interpreter's end."""


@atexit.register
def _stop_every_capture() -> None:
    for runtime in list(_CAPTURING):
        runtime.stop_captures()


@dataclass
class _Miss:
    reason: str
    count: int = 0


_CHOICE_CACHE_SIZE = 4096
_STAGED_CACHE_SIZE = 1024
_UNKNOWN = object()
"""A per-call-sizes cache's miss (its entries may be None)."""
PADDING_REASON, ONE_SEGMENT_REASON = "its padding", "its one-segment kernel"
"""Why a call runs at its exact sizes before any bucket (``VGraphRuntime._exact_first``)."""


@dataclass(frozen=True)
class _OneSegment:
    """A call whose one-segment kernel runs at its exact sizes where that run's launch hides behind ``work_ms``,
    its rows' share of the bucket's one-segment replay (``PaddingCosts.launch_hides``; None: untimed, never)."""

    work_ms: float | None


CAPTURE_GAP_S = 0.002
"""The captures thread's pause between two captures, with the lock released: a call waiting for the lock takes it
then (a lock released and taken again by the same running thread is seldom handed to a waiting one: on an H200 the
first call of a warm start waited for all 29 captures)."""


PADDED, SPLIT = "padded to the smallest bucket", "split over two buckets"
EXACT, STOCK = "compiled code at the exact size", "stock module"
CHOICES = (PADDED, SPLIT, EXACT, STOCK)
"""The per-call choices of ``call_choice="measured"``, as ``stats_table()`` counts them."""

_STOCK_REACH = 1.25
"""A stock timing stands for calls whose rows are within this factor of its own; past it, the stock is timed again."""


@dataclass(frozen=True)
class StockServed:
    """What ``VGraphRuntime`` returns for a call the stock module served: the module's own result (not graph
    outputs)."""

    result: Any


@dataclass(frozen=True)
class _KeyedReplay:
    """How the later calls of a key are served (``_serve_keyed``): the plan and bucket of the key's first replay,
    its staged fill, and the shape, dtype and device of each token input, which a later call must match to take
    them; every other input is the key's promise."""

    plan: CallPlan
    bucket: Bucket
    fill: fills.StagedFill
    tokens: tuple[tuple[int, torch.Size, torch.dtype, torch.device], ...]


@dataclass(frozen=True)
class _Split:
    """A call cut at ``segment``: each half's graph inputs, plan and bucket, and the table's cost of the two."""

    cost_ms: float
    halves: tuple[tuple[list[Any], CallPlan, Bucket], ...]


class VGraphRuntime:
    """Token-budget buckets for one dynamo trace, and the eager trace as fallback."""

    def __init__(
        self,
        encoder: CompiledEncoder,
        checks: CallChecks,
        device: torch.device,
        fixed_inputs: Sequence[Any],
        sources: Sequence[Any] | None = None,
        keep_first_outputs: bool = False,
    ) -> None:
        self.serial = next(_SERIALS)
        self.name = f"vgraph encoder #{self.serial}"
        self.encoder = encoder
        """The compiled graph and its buckets (built inside the backend's call, after the first call's checks, or
        assembled from a saved build plan)."""
        self.checks = checks
        self.spec = checks.spec
        self.config = checks.config
        self.device = device
        self.misses: dict[str, _Miss] = {}
        self._chosen: dict[tuple[int, ...], Bucket | None] = {}
        """The bucket chosen per call sizes, kept once the graphs are captured (a capture may drop buckets)."""
        self._views: dict[tuple[int, tuple[int, ...]], list[Any]] = {}
        """(budget, call sizes) -> the captured outputs narrowed to those sizes (views of static tensors)."""
        self._staged: dict[tuple[Hashable, int], torch.Tensor] = {}
        """(call key, budget) -> the bucket's metadata bytes as that key's first call filled them."""
        self._keyed: dict[Hashable, _KeyedReplay] = {}
        """Call key -> how its later calls are served under ``smallest_bucket`` (cleared with ``_staged``)."""
        self._lock = threading.Lock()
        self._last_stream: torch.cuda.Stream | None = None
        """The stream the previous call's work was queued on (CUDA)."""
        self.fixed_inputs = list(fixed_inputs)
        """The value of each input not read from the call's arguments (parameters, module state); None elsewhere."""
        self._parameters_need_grad = any(
            isinstance(value, torch.Tensor) and value.requires_grad for value in self.fixed_inputs
        )
        self.input_sources = list(sources) if sources is not None else None
        """Dynamo's source of each graph input (None where it has none); None for a runtime no trace made."""
        self.pinned_sources: frozenset[str] | None = None
        """Names of the argument sources whose values the trace specialized (dynamo guards them beyond their type);
        None where unknown (every constant argument then counts as specialized)."""
        self.serves = 0
        """Calls served (by a bucket or eagerly)."""
        self._keep_first_outputs = keep_first_outputs
        self.call_choice = self.config.call_choice
        """How calls that fit a bucket are served (``VGraphConfig.call_choice``); may be changed between calls (the
        cost table is measured when ``measured`` first needs it)."""
        self.padding: PaddingCosts | None = None
        """What padding rows cost against the compiled code at a call's exact sizes (measured at warm-up on CUDA)."""
        self.costs: CallCosts | None = None
        """The table the per-call choice reads (measured at warm-up with ``call_choice="measured"``)."""
        self.choices: collections.Counter[str] = collections.Counter()
        """Calls per choice (``CHOICES``) under every call_choice but smallest_bucket, whose replays are not counted
        here (its calls at their exact sizes are: ``_exact_first``)."""
        self._splitter = Splitter(self.spec) if can_split(self.spec) else None
        self._routes: dict[tuple[tuple[int, ...], bool], tuple[str, float]] = {}
        """Per (call sizes, stock offered): the cheapest of padding, the exact size and the stock module, and its
        cost (a split depends on the offsets' values)."""
        self._exact: dict[tuple[int, ...], dict[int, int] | None] = {}
        """Per call sizes: the size inputs of the compiled code at them, or None where it may not run at them (a size
        guard fails there)."""
        self._exact_first_choices: dict[tuple[int, ...], str | _OneSegment | None] = {}
        """Per call sizes: why the call runs at its exact sizes before any bucket (``PADDING_REASON``, or
        ``ONE_SEGMENT_REASON`` where nothing is timed), None where it does not, or, for a one-segment kernel, the
        work its launch must hide behind (weighed per call by the latest launch: ``_exact_first``)."""
        self.one_segment_host_ms: dict[bool, float] = {}
        """Host times of the one-segment calls run at their exact sizes for their kernel (their launches, not waiting
        on the GPU; CUDA with padding costs only), keyed by whether the call's sizes ran so before: the latest of a
        first run (which builds what a new shape needs: cuDNN's plan, say) and of a later one. ``_exact_first``
        weighs a call by the one of its kind (``PaddingCosts.launch_hides``), the warm-up's until it is measured."""
        self._exact_sizes_run: set[tuple[int, ...]] = set()
        """The call sizes (``plan.key``) a one-segment call ran at exactly (bounded like the choice caches)."""
        self.stock_ms: dict[int, list[tuple[int, float]]] = {}
        """Per bucket budget: (rows, ms) of each timed stock call it would have served; replaced, never changed in
        place (callers read it without the lock)."""
        self._stock_warm: set[int] = set()
        """Bucket budgets whose first stock call ran (untimed: cold); the next is timed."""
        self._split_floors: dict[int, float] = {}
        self._fills: dict[int, fills.BucketFills] = {}
        """Per bucket budget: its buffers' fills (made at the bucket's first call)."""
        self.agree_buckets: Callable[[set[int]], set[int]] | None = None
        """Over a group of processes whose graphs hold collectives: the budgets to serve from, given those this
        process captured (those every process captured, ``hf/parallel/rank_agreement.common_budgets``), asked once, after the
        captures and before any call is served; None: the captured ones."""
        self.first_outputs: list[Any] | None = None
        """With ``keep_first_outputs``: the outputs of the first call served (the decorator maps them to what the
        encoder returns, then drops them); no other call's outputs are kept."""
        self._behind: threading.Thread | None = None
        """The thread capturing the buckets behind the calls (``_start_captures``), once started."""
        self._behind_lock = threading.Lock()
        self._stop_captures = threading.Event()

    @property
    def buckets(self) -> list[Bucket]:
        return self.encoder.buckets

    def warmup(self) -> bool:
        """Capture every bucket's graph not captured yet, now, holding the lock (calls on other threads wait), and
        measure what the per-call choices read; returns once every graph is captured and measured (waiting for the
        captures thread where it is measuring: a caller that times calls after ``warmup()`` never runs beside that
        measurement). The first valid call does it otherwise, or starts the captures behind it
        (``VGraphConfig.captures``). True when this call finished the captures."""
        finished = False
        if not self.encoder.captured:
            with self._lock:
                if not self.encoder.captured:
                    self._on_call_stream()
                    self.encoder.warmup(self._prepare_capture, self.agree_buckets)
                    finished = True
        self._measure_padding()
        self._measure_costs()
        return finished

    def _prepare_capture(self, bucket: Bucket) -> None:
        fills.empty_bucket(bucket, self.encoder.roles)

    def _start_captures(self) -> None:
        """At a call before every graph is captured: capture them all now (``warmup``), or, with captures
        ``behind``, start the thread that captures them behind the calls (once). Never behind over a process
        group whose graphs hold collectives (``agree_buckets``) or under sequence parallelism: every rank must
        capture the same graphs at the same call."""
        if self.encoder.captured or self._behind is not None:
            return
        behind = (
            self.config.captures == "behind"
            and self.encoder.cudagraphs
            and self.agree_buckets is None
            and self.config.sequence_parallel is None
        )
        if not behind:
            self.warmup()
            return
        with self._behind_lock:
            if self._behind is None and not self.encoder.captured:
                name = f"{self.name}: captures"
                self._behind = threading.Thread(target=self._capture_behind, name=name, daemon=True)
                _CAPTURING.add(self)
                self._behind.start()

    def _capture_behind(self) -> None:
        """The captures thread: each bucket, largest first, captured holding the lock (calls wait for one capture
        at most, and run in the pause between two: ``CAPTURE_GAP_S``), then ``warmup`` (nothing left to capture: the
        buckets are final, the padding costs loaded or timed). A failure is logged; calls keep running without graphs
        until a ``warmup()`` captures again."""
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                for bucket in self.encoder.largest_first():
                    if self._stop_captures.is_set():
                        return
                    with self._lock:
                        self._on_call_stream()
                        self.encoder.capture_one(bucket, self._prepare_capture)
                    time.sleep(CAPTURE_GAP_S)
                self.warmup()
        except Exception:
            log.exception("%s: capturing behind the calls failed; calls run without graphs until warmup()", self.name)

    def stop_captures(self) -> None:
        """Stop the captures thread after its current capture and wait for it (at exit, and before ``release``)."""
        self._stop_captures.set()
        thread = self._behind
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _measure_padding(self) -> None:
        """The padding costs (``call_costs.PaddingCosts``), once the graphs are captured on CUDA: what a call's
        padding rows cost against running the compiled code at its exact sizes. Never under sequence parallelism,
        whose ranks must run the same graphs."""
        if (
            self.padding is not None
            or not self.encoder.captured
            or not self.encoder.cudagraphs
            or not self.buckets
            or self.config.sequence_parallel is not None
        ):
            return
        with self._lock, startup_phases.phase("padding_costs"):
            if self.padding is None:
                key = self._padding_costs_key()
                self.padding = load_padding_costs(key) if key is not None else None
                if self.padding is not None:
                    counters.padding_costs_loaded += 1
                else:
                    self.padding = self._measure(measure_padding_costs)
                    if key is not None:
                        save_padding_costs(key, self.padding)
                self._exact_first_choices.clear()  # after: a choice made without the costs is not kept,
                self._keyed.clear()  # nor a key's replay that skips the choice

    def _padding_costs_key(self) -> str | None:
        """The key the padding costs are saved under: the saved compiled code and the buckets served (None where the
        code is not saved: nothing names it across processes)."""
        key = self.encoder.record.artifact_key
        return None if key is None else f"{key}|{','.join(str(bucket.shape.budget) for bucket in self.buckets)}"

    def _measure_costs(self) -> None:
        """The cost table, once ``measured`` needs it and the graphs are captured; measured once, holding the lock
        (it fills and runs the buckets)."""
        if self.call_choice != "measured" or self.costs is not None or not self.buckets or not self.encoder.captured:
            return
        with self._lock, startup_phases.phase("call_costs"):
            if self.costs is None:
                self.costs = self._measure(measure_call_costs)

    def _measure(self, measure: Callable[..., Any]) -> Any:
        """``measure`` (a ``serve/call_costs`` measurement) over the buckets, their replays and the compiled code,
        on the call stream; the caller holds the lock."""
        self._on_call_stream()
        return measure(
            self.buckets,
            lambda bucket: bucket.run(self.encoder.compiled),
            self.encoder.compiled,
            self.spec,
            self.encoder.roles,
            self.device,
        )

    @property
    def offers_stock(self) -> bool:
        """Whether a caller that can run the user's module on a call should offer it (``stock`` of ``__call__``)."""
        return self.call_choice in ("measured", "stock")

    def keep_buckets(self, budgets: set[int]) -> None:
        """Serve from the buckets of ``budgets`` only (the others' graphs reset): the processes of a group whose
        graphs hold collectives keep the buckets every one of them captured, so all choose alike."""
        with self._lock:
            self.encoder.keep_buckets(budgets)
            self._forget_buckets()

    def release(self) -> None:
        """Reset every captured graph (``CompiledEncoder.release``); later calls run eagerly."""
        self.stop_captures()
        with self._lock:
            self.encoder.release()
            self._forget_buckets()

    def _forget_buckets(self) -> None:
        """Drop every cache that holds a bucket, its buffers or a choice among the buckets (under the lock)."""
        caches = (self._chosen, self._views, self._routes, self._exact, self._exact_first_choices, self._fills)
        for cache in (*caches, self._staged, self._keyed):
            cache.clear()
        self._split_floors.clear()

    def _on_call_stream(self) -> None:
        """Order this call's work after the previous call's (under the lock): a call on another stream than the
        previous one's first waits for everything queued there, its copy-out included."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if self._last_stream is not None and stream != self._last_stream:
                stream.wait_stream(self._last_stream)
            self._last_stream = stream

    # -- per call ----------------------------------------------------------------------------------------------

    @staticmethod
    def _violating(shape: BucketShape, sizes: dict[sympy.Symbol, int]) -> Iterator[tuple[sympy.Symbol, int, int]]:
        """(symbol, real size, bucket size) for each size that keeps a call out of ``shape``: a bounded size over
        its bound, or a pinned size that differs. Lazy, so the fit check stops at the first."""
        for symbol, value in shape.values.items():
            real = sizes.get(symbol, value)
            if symbol in shape.fixed:
                if real != value:
                    yield symbol, real, value
            elif real > value:
                yield symbol, real, value

    def _choose(self, plan: CallPlan) -> Bucket | None:
        """The smallest bucket no size of the call exceeds; remembered per sizes once the graphs are captured."""
        if plan.key in self._chosen:
            return self._chosen[plan.key]
        bucket = next((b for b in self.buckets if next(self._violating(b.shape, plan.sizes), None) is None), None)
        if self.encoder.captured:
            if len(self._chosen) >= _CHOICE_CACHE_SIZE:
                self._chosen.clear()
            self._chosen[plan.key] = bucket
        return bucket

    def _budget_for(self, rows: int) -> int | None:
        """The smallest budget holding ``rows`` (sizes other than the rows are checked once a split is chosen)."""
        return next((budget for budget in self.costs.budgets if budget >= rows), None)

    def _split_floor(self, rows: int) -> float:
        """The table's cheapest pair of replays whose budgets add up to ``rows``: no split of the call costs less."""
        floor = self._split_floors.get(rows)
        if floor is None:
            costs = self.costs
            pairs = [
                costs.replay_ms[i] + costs.replay_ms[j]
                for i, first in enumerate(costs.budgets)
                for j, second in enumerate(costs.budgets[i:], i)
                if first + second >= rows
            ]
            floor = self._split_floors[rows] = min(pairs, default=float("inf"))
        return floor

    def _best_split(self, args: Sequence[Any], plan: CallPlan, under: float) -> _Split | None:
        """The cheapest cut at a segment boundary by the table, if it costs less than ``under`` and both halves
        fit a bucket."""
        offsets = args[self._splitter.offsets_input].tolist()
        best, best_cost = None, under
        for segment in range(1, len(offsets) - 1):
            first, second = self._budget_for(offsets[segment]), self._budget_for(offsets[-1] - offsets[segment])
            if offsets[segment] and offsets[-1] - offsets[segment] and first and second:
                cost = self.costs.replay(first) + self.costs.replay(second)
                if cost < best_cost:
                    best, best_cost = segment, cost
        if best is None:
            return None
        halves = []
        for half in self._splitter.halves(args, offsets, best):
            half_plan = self.checks.check(half)
            bucket = self._choose(half_plan)
            if bucket is None:
                return None
            halves.append((half, half_plan, bucket))
        cost = sum(self.costs.replay(bucket.shape.budget) for _, _, bucket in halves)
        return _Split(cost, tuple(halves)) if cost < under else None

    def _stock_estimate(self, budget: int, rows: int) -> float | None:
        """The stock module's time for a call of ``rows`` served by the bucket of ``budget``: the nearest timed
        call's, scaled by rows; None when no timed call is within ``_STOCK_REACH`` of it (time one)."""
        samples = self.stock_ms.get(budget)
        if not samples:
            return None
        timed_rows, ms = min(samples, key=lambda sample: abs(sample[0] - rows))
        if max(rows, 1) > timed_rows * _STOCK_REACH or rows * _STOCK_REACH < timed_rows:
            return None
        return ms * max(rows, 1) / max(timed_rows, 1)

    def _stock_floor(self, rows: int) -> float:
        """The least the stock module can take on a call of ``rows``: the slowest stock call timed with no more rows,
        in any bucket (0 before any)."""
        return max((ms for samples in self.stock_ms.values() for timed, ms in samples if timed <= rows), default=0.0)

    def _route(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, stock: bool) -> tuple[str, _Split | None]:
        """How to run a call that fits ``bucket``: the fixed choice, or the cheapest by the cost table (``STOCK``
        also where the stock module's time for the call is unknown and could be the cheapest: it is timed then)."""
        if self.call_choice == "exact_size":
            return (EXACT if self._exact_allowed(bucket, plan) else PADDED), None
        if self.call_choice == "stock":
            return (STOCK if stock else PADDED), None
        route = self._routes.get((plan.key, stock))
        if route is None:
            options = {PADDED: self.costs.replay(bucket.shape.budget)}
            if self._exact_allowed(bucket, plan):
                options[EXACT] = self.costs.exact(plan.tokens)
            if stock:
                estimate = self._stock_estimate(bucket.shape.budget, plan.tokens)
                if estimate is not None:
                    options[STOCK] = estimate
                elif self._stock_floor(plan.tokens) < min(options.values()):
                    return STOCK, None
            route = min(options.items(), key=lambda option: option[1])
            if len(self._routes) >= _CHOICE_CACHE_SIZE:
                self._routes.clear()
            self._routes[plan.key, stock] = route
        choice, cost = route
        if self._splitter is not None and self._split_floor(plan.tokens) < cost:
            split = self._best_split(args, plan, cost)
            if split is not None:
                return SPLIT, split
        return choice, None

    # -- the compiled code at a call's exact sizes -------------------------------------------------------------

    def _exact_values(self, bucket: Bucket, plan: CallPlan) -> dict[sympy.Symbol, int]:
        """Every size symbol at the call's own value; the bucket's for those the call does not bind (bounds such as
        a max_seqlen, which the call's sizes stay under)."""
        values = {**bucket.shape.values, **plan.sizes}
        for symbol, expr in self.spec.relations.items():
            values[symbol] = evaluate(expr, plan.sizes, "a related size")
        return values

    def _exact_allowed(self, bucket: Bucket, plan: CallPlan) -> bool:
        """Whether the compiled code may run at the call's sizes: every size guard of its trace and compile holds
        there (known at build; unknown guards allow nothing)."""
        return self._exact_sizes(bucket, plan) is not None

    def _exact_sizes(self, bucket: Bucket, plan: CallPlan) -> dict[int, int] | None:
        """The compiled code's size inputs at the call's sizes, worked out once per call sizes; None where a size
        guard fails there."""
        known = self._exact.get(plan.key, _UNKNOWN)  # one read: another thread may clear the cache between two
        if known is not _UNKNOWN:
            return known
        guards = self.encoder.record.size_guards
        values = self._exact_values(bucket, plan)
        sizes = None
        if guards is not None and all(substitute(guard, values) == sympy.true for guard in guards):
            layout = self.encoder.record.layout
            sizes = {index: evaluate(expr, values, "a size input") for index, expr in layout.sizes.items()}
        if len(self._exact) >= _CHOICE_CACHE_SIZE:
            self._exact.clear()
        self._exact[plan.key] = sizes
        return sizes

    def _exact_first(self, bucket: Bucket, plan: CallPlan) -> str | None:
        """Why the call runs the compiled code at its exact sizes rather than any bucket (None: it does not), where
        the code may run at its sizes: its padding rows cost more than the exact run's host launch can lose
        (``PaddingCosts.exact_saves``: ``PADDING_REASON``), or a one-segment kernel (``_one_segment_kernel``) whose
        launch hides behind the call's work (``PaddingCosts.launch_hides``, by ``one_segment_host_ms`` of the call's
        kind once a one-segment exact run measured it; the kernel's own timing cannot tell: ``ONE_SEGMENT_REASON``).
        Per call sizes the choice is made once, but for a one-segment kernel the latest launch is weighed per call
        (a float comparison)."""
        known = self._exact_first_choices.get(plan.key, _UNKNOWN)
        if known is _UNKNOWN:
            known = self._exact_first_choice(bucket, plan)
            if len(self._exact_first_choices) >= _CHOICE_CACHE_SIZE:
                self._exact_first_choices.clear()
            self._exact_first_choices[plan.key] = known
        if isinstance(known, _OneSegment):
            host_ms = self.one_segment_host_ms.get(plan.key in self._exact_sizes_run)
            return ONE_SEGMENT_REASON if self.padding.launch_hides(known.work_ms, host_ms) else None
        return known

    def _exact_first_choice(self, bucket: Bucket, plan: CallPlan) -> str | _OneSegment | None:
        """``_exact_first``'s choice for the call's sizes, made once per sizes."""
        padding, budget = self.padding, bucket.shape.budget
        if padding is not None and padding.exact_saves(budget, plan.tokens):
            reason = PADDING_REASON
        elif not self._one_segment_kernel(bucket, plan):
            return None
        elif padding is None:  # no graphs to leave (the CPU), or not measured yet
            reason = ONE_SEGMENT_REASON
        else:
            reason = _OneSegment(padding.one_segment_work(budget, plan.tokens))
        return reason if self._exact_allowed(bucket, plan) else None

    def _one_segment_kernel(self, bucket: Bucket, plan: CallPlan) -> bool:
        """Whether some attention group holds one segment in the call, and that group's kernels give one segment of
        the call's rows another kernel than the bucket's (``registry.by_rows``: measured to save more than an
        exact-size call costs on the host). Never under sequence parallelism, whose ranks must run the same
        graphs."""
        if self.config.sequence_parallel is not None or not self._one_segment_groups:
            return False
        values = self._exact_values(bucket, plan)
        for group, (name, site_rows) in self._one_segment_groups.items():
            if evaluate(self.spec.groups[group].segments, values, "a group's segment count") != 1:
                continue
            rows = evaluate(site_rows, values, "an attention site's rows")
            bucket_rows = evaluate(site_rows, bucket.shape.values, "an attention site's rows")
            if registry.pick(name, rows, 1) != registry.pick(name, bucket_rows, bucket.shape.segments[group]):
                return True
        return False

    @functools.cached_property
    def _one_segment_groups(self) -> dict[int, tuple[str, sympy.Expr]]:
        """Attention group -> (its kernels, its sites' rows), for the groups whose kernels give calls of one segment
        kernels of their own (the build's choice, fixed once the encoder is built)."""
        groups = {}
        for site in self.spec.sites:
            name = self.encoder.kernels.get(site.group)
            if name is not None and registry.has_one_segment_entries(name):
                groups.setdefault(site.group, (name, site.rows))
        return groups

    def _run_exact(
        self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, reason: str | None = None
    ) -> list[Any]:
        """The compiled code on the call's own tensors (contiguous), no bucket buffer and no graph: its outputs are
        fresh tensors at the call's sizes. Holding the lock: the kernels' workspaces are the graphs' too. A call sent
        here for its one-segment kernel (``reason``) with padding costs measured times its launch
        (``one_segment_host_ms``, by whether its sizes ran so before), which later such calls are weighed by."""
        inputs = list(bucket.inputs)
        for index in self.encoder.record.layout.copied:
            inputs[index] = args[index].contiguous()
        for index, size in self._exact_sizes(bucket, plan).items():
            inputs[index] = size
        timed = reason == ONE_SEGMENT_REASON and self.padding is not None
        with self._lock:
            self._on_call_stream()
            begin = time.perf_counter()
            outputs = list(self.encoder.compiled(inputs))
            if timed:
                if len(self._exact_sizes_run) >= _CHOICE_CACHE_SIZE:
                    self._exact_sizes_run.clear()
                self.one_segment_host_ms[plan.key in self._exact_sizes_run] = (time.perf_counter() - begin) * 1e3
                self._exact_sizes_run.add(plan.key)
        return outputs

    def _run_stock(self, stock: Callable[[], Any], budget: int, rows: int) -> StockServed:
        """The stock module on the call; timed (and the routes recomputed) when ``measured`` has no timing that
        stands for it, from a bucket's second stock call on (the first pays the stock code's own cold start)."""
        if self.call_choice != "measured" or self._stock_estimate(budget, rows) is not None:
            return StockServed(stock())
        if budget not in self._stock_warm and budget not in self.stock_ms:  # cold: kernel plans, autotune
            self._stock_warm.add(budget)
            return StockServed(stock())
        served: list[Any] = []
        ms = median_ms(lambda: served.append(stock()), self.device, repeats=1, warm=False)
        with self._lock:
            self.stock_ms = {**self.stock_ms, budget: [*self.stock_ms.get(budget, ()), (rows, ms)]}
            self._routes.clear()
        return StockServed(served[-1])

    def _miss(self, reason: str, args: Sequence[Any], detail: str = "") -> Any:
        miss = self.misses.setdefault(reason, _Miss(reason))
        if miss.count == 0:
            log.warning("%s: %s%s; running it eagerly (logged once per reason)", self.name, reason, detail)
        miss.count += 1
        counters.eager_fallbacks += 1
        outputs = self.encoder.eager(*args)
        self._remember_first(list(outputs))
        return outputs

    def _no_bucket(self, args: Sequence[Any], sizes: dict[sympy.Symbol, int]) -> Any:
        if not self.buckets:
            return self._miss("no bucket was built (see the warnings above)", args)
        largest = self.buckets[-1].shape
        over = sorted(self._violating(largest, sizes), key=lambda violation: str(violation[0]))
        reason = "no bucket holds " + ", ".join(self.spec.describe(symbol) for symbol, _, _ in over)
        detail = ", ".join(
            f"{self.spec.describe(symbol)}={real} {'!=' if symbol in largest.fixed else '>'} {value}"
            for symbol, real, value in over
        )
        return self._miss(reason, args, f" ({detail})")

    def _remember_first(self, outputs: list[Any]) -> None:
        if self.serves == 0 and self._keep_first_outputs:
            self.first_outputs = outputs
        self.serves += 1

    def _narrow(self, bucket: Bucket, outputs: Sequence[Any], plan: CallPlan) -> list[Any]:
        """The outputs at the call's real sizes, copied out of the bucket's memory in one launch.

        The copy stays: the outputs are the captured graph's static tensors, which the next call's replay
        overwrites, and that replay may be queued (the lock is released once the work is queued) before this caller
        reads its results. A view would hand callers rows another call rewrites. The narrowed views are made once
        per bucket and call sizes; each call allocates its results and copies every tensor output into them with
        one ``torch._foreach_copy_``."""
        views = self._views.get((bucket.shape.budget, plan.key)) if bucket.graph is not None else None
        if views is None:
            views = []
            for output, narrow in zip(outputs, plan.narrow):
                if isinstance(narrow, tuple) and isinstance(output, torch.Tensor):
                    for dim, size in narrow:
                        output = output.narrow(dim, 0, size)
                elif isinstance(narrow, int):
                    output = narrow
                views.append(output)
            if bucket.graph is not None:  # static outputs: the views stay valid
                if len(self._views) >= _CHOICE_CACHE_SIZE:
                    self._views.clear()
                self._views[bucket.shape.budget, plan.key] = views
        results = [torch.empty_like(view) if isinstance(view, torch.Tensor) else view for view in views]
        tensors = [index for index, view in enumerate(views) if isinstance(view, torch.Tensor)]
        if tensors:
            torch._foreach_copy_([results[index] for index in tensors], [views[index] for index in tensors])
        return results

    def __call__(
        self, *args: Any, key: Hashable = None, stock: Callable[[], Any] | None = None
    ) -> list[Any] | StockServed:
        """Serve one call of graph inputs ``args``. A ``key`` promises that every input but the token rows equals
        that of any earlier call with the same key (the HF towers pass the grid, whose metadata vgraph caches): the
        bucket's metadata then takes the bytes staged at that call, in one copy. ``stock`` runs the user's own module
        on this call (the caller's arguments); with a cost table, the call may take it (``StockServed``).

        A key replayed before under ``smallest_bucket`` takes that replay's plan, bucket and fill as they are, with no
        size check, bucket choice or fill rule (``_serve_keyed``), when its token inputs match that call's."""
        if key is not None and self.call_choice == "smallest_bucket" and not torch.is_grad_enabled():
            keyed = self._keyed.get(key)
            if keyed is not None:
                results = self._serve_keyed(keyed, args)
                if results is not None:
                    return results
        plan = self.checks.check(args)
        grad = torch.is_grad_enabled()
        if grad and (self._parameters_need_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self._miss("autograd is enabled (vgraph graphs are inference-only: use torch.no_grad())", args)
        changed = [  # the hot path passes the traced tensor itself: no read of it per call
            index
            for index, value in self.encoder.folded.items()
            if args[index] is not self.fixed_inputs[index] and args[index].item() != value
        ]
        if changed:
            names = ", ".join(self.spec.describe_input(index) for index in changed)
            return self._miss(f"{names} differ from the values the graphs were built with", args)
        self._start_captures()
        bucket = self._choose(plan)
        if bucket is None:
            return self._no_bucket(args, plan.sizes)
        self._measure_padding()
        self._measure_costs()
        with torch.no_grad() if grad else contextlib.nullcontext():
            if bucket.graph is None and not self.encoder.captured:
                results = self._serve_uncaptured(bucket, args, plan)
            elif self.call_choice in ("smallest_bucket", "measured") and (reason := self._exact_first(bucket, plan)):
                self.choices[EXACT] += 1
                results = self._run_exact(bucket, args, plan, reason)
            elif self.call_choice == "smallest_bucket" or (self.call_choice == "measured" and self.costs is None):
                results = self._replay(bucket, args, plan, key)
            else:
                choice, split = self._route(bucket, args, plan, stock is not None)
                self.choices[choice] += 1
                if choice == PADDED:
                    results = self._replay(bucket, args, plan, key)
                elif choice == EXACT:
                    results = self._run_exact(bucket, args, plan)
                elif choice == STOCK:
                    self.serves += 1
                    return self._run_stock(stock, bucket.shape.budget, plan.tokens)
                else:
                    results = self._splitter.join(*(self._replay(b, half, p) for half, p, b in split.halves))
        self._remember_first(results)
        return results

    def _serve_uncaptured(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan) -> list[Any]:
        """A call whose bucket's graph is still to be captured behind the calls: the compiled code at the call's
        exact sizes, or on the bucket's buffers (padded, no graph) where a size guard fails at them. No key is
        staged: a key's replays are recorded once its bucket replays."""
        counters.served_before_capture += 1
        if self._exact_allowed(bucket, plan):
            return self._run_exact(bucket, args, plan)
        return self._replay(bucket, args, plan, counted=False)

    def _replay(
        self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, key: Hashable = None, counted: bool = True
    ) -> list[Any]:
        """Serve one call by ``bucket``: fill (by the staged bytes of ``key``, when given), replay, narrow and copy
        out, holding the lock. A split call's halves pass no key: their metadata is not the key's. ``counted``: a
        replay of the bucket (False: its compiled code run on its buffers before its graph is captured)."""
        with self._lock:
            self._on_call_stream()
            self._fill(bucket, args, plan, key)
            results = self._narrow(bucket, bucket.run(self.encoder.compiled), plan)
            if counted:
                self._count_replay(bucket, plan)
        return results

    def _serve_keyed(self, keyed: _KeyedReplay, args: Sequence[Any]) -> list[Any] | None:
        """A call of a key served before: its token inputs checked against that call's (their shape, dtype and
        device: with the key's promise for the rest, the call's sizes, plan and bucket are that call's), then its
        staged fill, the replay and the copy-out, holding the lock. None, with nothing run, where a token input
        differs or has no byte view: the call takes the general path, which checks it."""
        for index, shape, dtype, device in keyed.tokens:
            value = args[index]
            if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (shape, dtype, device):
                return None
        bucket, plan = keyed.bucket, keyed.plan
        with self._lock:
            self._on_call_stream()
            if not keyed.fill.fill(args):
                return None
            results = self._narrow(bucket, bucket.run(self.encoder.compiled), plan)
            self._count_replay(bucket, plan)
        self._remember_first(results)
        return results

    @staticmethod
    def _count_replay(bucket: Bucket, plan: CallPlan) -> None:
        bucket.stats.hits += 1
        bucket.stats.real_tokens += plan.tokens
        counters.replays += 1

    def _fill(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, key: Hashable) -> None:
        """Every buffer, every call: an unkeyed call's metadata too (a tensor can change without its version
        counter moving). A keyed call's metadata comes from the bytes staged at the key's first call here, and the
        key's later calls are served as this one (``_keyed``; not where an input is a folded constant, which is
        checked per call)."""
        bucket_fills = self._fills.get(bucket.shape.budget)
        if bucket_fills is None:
            bucket_fills = self._fills[bucket.shape.budget] = fills.BucketFills(bucket, self.encoder.roles)
        if key is None or bucket.region is None:
            bucket_fills.fill(args, plan.written)
            return
        staged = self._staged.get((key, bucket.shape.budget))
        if staged is not None:
            bucket_fills.fill(args, plan.written, staged)
        else:
            bucket_fills.fill(args, plan.written)
            if len(self._staged) >= _STAGED_CACHE_SIZE:
                self._staged.clear()
                self._keyed.clear()
            staged = self._staged[key, bucket.shape.budget] = bucket.region.clone()
        if key not in self._keyed and not self.encoder.folded:
            fill = bucket_fills.staged_fill(args, staged)
            if fill is not None:
                tokens = tuple((i, args[i].shape, args[i].dtype, args[i].device) for i in fill.tokens)
                self._keyed[key] = _KeyedReplay(plan, bucket, fill, tokens)

    # -- reporting ---------------------------------------------------------------------------------------------
    def stats_table(self) -> str:
        """Per-bucket hits and padding, pool memory, the dropped budgets (each with its reason) and the eager
        fallbacks, as a printable table."""
        lines = [
            "budget: token rows the bucket holds; segments, max_seqlen: per attention group; hits: calls served; "
            "padded: share of its rows that were padding",
            f"{'budget':>8} {'segments':>9} {'max_seqlen':>11} {'hits':>6} {'padded':>7}",
        ]
        for bucket in self.buckets:
            stats = bucket.stats
            lines.append(
                f"{stats.budget:>8} {str(list(bucket.shape.segments)):>9} "
                f"{str(list(bucket.shape.max_seqlen)):>11} {stats.hits:>6} {stats.padded_fraction:>7.1%}"
            )
        if self.encoder.kernels:
            kernels = ", ".join(f"group {group}: {name}" for group, name in sorted(self.encoder.kernels.items()))
            lines.append(f"attention kernels: {kernels}")
        if self.encoder.cudagraphs:
            lines.append(f"graph pool: {self.encoder.pool_bytes / 2**20:.1f} MiB for {len(self.buckets)} graphs")
        if self.choices:
            choices = ", ".join(f"{choice} x{self.choices[choice]}" for choice in CHOICES)
            lines.append(f"per-call choice ({self.call_choice}): {choices}")
        if self.padding is not None:
            lines.append("padding costs: " + self.padding.format())
        if self.one_segment_host_ms:
            launches = ", ".join(
                f"{'later runs' if again else 'first run of its sizes'} {ms:.3f} ms"
                for again, ms in sorted(self.one_segment_host_ms.items())
            )
            lines.append(f"one-segment calls at their exact sizes, latest host launch: {launches}")
        if self.costs is not None:
            lines.append("measured costs (ms):\n" + self.costs.format())
        for budget, samples in sorted(self.stock_ms.items()):
            timed = ", ".join(f"{rows} rows {ms:.3f} ms" for rows, ms in samples)
            lines.append(f"stock module timed in bucket {budget}: {timed}")
        for dropped in self.encoder.dropped:
            lines.append(dropped.format())
        for miss in self.misses.values():
            lines.append(f"eager fallback x{miss.count}: {miss.reason}")
        return "\n".join(lines)

    @property
    def hits(self) -> int:
        return sum(bucket.stats.hits for bucket in self.buckets)
