"""``VGraphRuntime``: serves the calls of one traced encoder from the buckets its build made.

Per call: read the real sizes from the inputs, validate them (before anything runs), choose the smallest bucket
that holds every size, then, holding the runtime's lock: fill the bucket's buffers by each input's padding rule
(a keyed call's metadata by one copy of the bytes staged at its key's first call), replay (or run) the bucket,
narrow the outputs to the real sizes and copy them out. A call no bucket holds runs
the traced graph eagerly, counted and logged once per reason; so does a call that needs autograd (the buckets
are inference-only).

With ``call_choice="measured"``, the warm-up also times every bucket's replay and
the eager graph at its sizes (``compile/call_costs``), and a call that fits a bucket takes the cheapest by that
table of: padding it to the smallest bucket, splitting it at a segment boundary over two smaller buckets (where
``serve/split.can_split`` allows; the offsets are read only when the table says a split could win), and running
it eagerly. ``stats_table()`` counts each choice.

Concurrency: the lock covers fill to copy-out, so callers on several threads never see each other's rows. On
CUDA the lock is released once the work is queued, not finished. Calls on one stream are ordered by it; a call on
another stream than the previous call's first waits for everything queued on that stream so far (its copy-out
included) before its fill, so callers on different streams are ordered too, and a single-stream caller pays for no
event. The returned tensors are fresh and safe to read on the caller's stream.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Sequence

import sympy
import torch

from vgraph_compile.compile.build import CompiledEncoder
from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.compile.call_costs import CallCosts, measure_call_costs
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.spec import BucketShape
from vgraph_compile.serve.checks import CallChecks, CallPlan
from vgraph_compile.serve.split import Splitter, can_split

__all__ = ["VGraphRuntime"]

log = logging.getLogger(__name__)

_SERIALS = itertools.count(1)


@dataclass
class _Miss:
    reason: str
    count: int = 0


_CHOICE_CACHE_SIZE = 4096
_STAGED_CACHE_SIZE = 1024

PADDED, SPLIT, EAGER = "padded to the smallest bucket", "split over two buckets", "run eagerly (cheaper)"
"""The per-call choices of ``call_choice="measured"``, as ``stats_table()`` counts them."""


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
        self.serves = 0
        """Calls served (by a bucket or eagerly)."""
        self._keep_first_outputs = keep_first_outputs
        self.costs: CallCosts | None = None
        """The table the per-call choice reads (measured at warm-up with ``call_choice="measured"``)."""
        self.choices: collections.Counter[str] = collections.Counter()
        """Calls per choice (``PADDED``, ``SPLIT``, ``EAGER``) while a cost table is set."""
        self._splitter = Splitter(self.spec) if can_split(self.spec) else None
        self._routes: dict[tuple[int, ...], tuple[str, float]] = {}
        """Per call sizes: the cheaper of padding and eager, and its cost (a split depends on the offsets' values)."""
        self._split_floors: dict[int, float] = {}
        self.first_outputs: list[Any] | None = None
        """With ``keep_first_outputs``: the outputs of the first call served (the decorator maps them to what the
        encoder returns, then drops them); no other call's outputs are kept."""

    @property
    def buckets(self) -> list[Bucket]:
        return self.encoder.buckets

    def warmup(self) -> bool:
        """Capture every bucket's graph now (the first valid call does it otherwise). True when this call captured."""
        if self.encoder.captured:
            return False
        self.encoder.warmup()
        if self.config.call_choice == "measured" and self.buckets:
            with startup_phases.phase("call_costs"):
                self.costs = self._measured_costs()
        return True

    def _measured_costs(self) -> CallCosts:
        """The cost table of this runtime's buckets, measured now."""
        return measure_call_costs(
            self.buckets,
            lambda bucket: bucket.run(self.encoder.compiled),
            self.encoder.eager,
            self.spec,
            self.encoder.roles,
            self.device,
        )

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

    def _route(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan) -> tuple[str, _Split | None]:
        """The cheapest way to run a call that fits ``bucket``, by the cost table."""
        route = self._routes.get(plan.key)
        if route is None:
            pad, eager = self.costs.replay(bucket.shape.budget), self.costs.eager(plan.tokens)
            route = (PADDED, pad) if pad <= eager else (EAGER, eager)
            if len(self._routes) >= _CHOICE_CACHE_SIZE:
                self._routes.clear()
            self._routes[plan.key] = route
        choice, cost = route
        if self._splitter is not None and self._split_floor(plan.tokens) < cost:
            split = self._best_split(args, plan, cost)
            if split is not None:
                return SPLIT, split
        return choice, None

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

    def __call__(self, *args: Any, key: Hashable = None) -> list[Any]:
        """Serve one call of graph inputs ``args``. A ``key`` promises that every input but the token rows equals
        that of any earlier call with the same key (the HF towers pass the grid, whose metadata vgraph caches): the
        bucket's metadata then takes the bytes staged at that call, in one copy."""
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
        self.warmup()
        bucket = self._choose(plan)
        if bucket is None:
            return self._no_bucket(args, plan.sizes)
        with torch.no_grad() if grad else contextlib.nullcontext():
            if self.costs is None:
                results = self._replay(bucket, args, plan, key)
            else:
                choice, split = self._route(bucket, args, plan)
                self.choices[choice] += 1
                if choice == PADDED:
                    results = self._replay(bucket, args, plan, key)
                elif choice == EAGER:
                    results = list(self.encoder.eager(*args))
                else:
                    results = self._splitter.join(*(self._replay(b, half, p) for half, p, b in split.halves))
        self._remember_first(results)
        return results

    def _replay(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, key: Hashable = None) -> list[Any]:
        """Serve one call by ``bucket``: fill (by the staged bytes of ``key``, when given), replay, narrow and copy
        out, holding the lock. A split call's halves pass no key: their metadata is not the key's."""
        with self._lock:
            if self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                if self._last_stream is not None and stream != self._last_stream:
                    stream.wait_stream(self._last_stream)  # after the previous call's copy-out, queued there
                self._last_stream = stream
            self._fill(bucket, args, plan, key)
            results = self._narrow(bucket, bucket.run(self.encoder.compiled), plan)
            bucket.stats.hits += 1
            bucket.stats.real_tokens += plan.tokens
            counters.replays += 1
        return results

    def _fill(self, bucket: Bucket, args: Sequence[Any], plan: CallPlan, key: Hashable) -> None:
        """Every buffer, every call: an unkeyed call's metadata too (a tensor can change without its version
        counter moving). A keyed call's metadata comes from the bytes staged at the key's first call here."""
        if key is None or bucket.region is None:
            bucket.fill(args, plan.written)
            return
        staged = self._staged.get((key, bucket.shape.budget))
        if staged is not None:
            bucket.fill(args, plan.written, staged)
            return
        bucket.fill(args, plan.written)
        if len(self._staged) >= _STAGED_CACHE_SIZE:
            self._staged.clear()
        self._staged[key, bucket.shape.budget] = bucket.region.clone()

    # -- reporting ---------------------------------------------------------------------------------------------
    def stats_table(self) -> str:
        """Per-bucket hits and padding, pool memory and the eager fallbacks, as a printable table."""
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
        if self.costs is not None:
            choices = ", ".join(f"{choice} x{self.choices[choice]}" for choice in (PADDED, SPLIT, EAGER))
            lines.append(f"per-call choice by the measured costs: {choices}")
        for miss in self.misses.values():
            lines.append(f"eager fallback x{miss.count}: {miss.reason}")
        return "\n".join(lines)

    @property
    def hits(self) -> int:
        return sum(bucket.stats.hits for bucket in self.buckets)
