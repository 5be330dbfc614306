"""The cost tables the runtime's per-call choice reads. ``PaddingCosts`` (every CUDA runtime, at warm-up): what a
call's padding rows cost against the host launch of the compiled code at its exact sizes. ``CallCosts``
(``call_choice="measured"``): each bucket's replay time and the compiled code's time at
each bucket's sizes run without a graph (as a call at its exact sizes runs it), measured once at warm-up, after the
capture.

Each bucket is timed full, the way large calls use it: its floating token buffers hold random values (never zeros,
which run faster than real data), and each attention group whose offsets the graph reads as they are
(``AttentionGroup.ends_at``) is cut into segments of the bucket's ``max_seqlen`` up to its rows (the group's
costliest valid fill), and a group whose offsets are an input with no known end holds one such segment; every other
buffer holds what a call with no tokens holds. Times are medians of a few runs
(CUDA events on CUDA, the host clock on the CPU). The runtime interpolates the exact-size times between budgets for
a call's real rows; the replay time of a bucket does not depend on the call it serves. The stock module's time is
not in this table: the runtime cannot call the user's module from graph inputs, so it times the stock module on the
first call its caller lets it serve per bucket (``serve/runtime``).

The padding costs are saved in ``vgraph_padding_costs.json`` under inductor's cache directory, keyed by the saved
compiled code (``compile/artifacts.artifact_key``: its graph, config, kernels, torch and device) and the buckets
captured: a warm start with the same code and GPU loads them instead of timing its buckets again (4 s of a 10 s
warm start of the released Qwen3-VL tower on an H200).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from vgraph_compile import json_cache
from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.serve import fills
from vgraph_compile.spec import Role, VarlenSpec
from vgraph_compile.symbolic import evaluate

__all__ = [
    "CallCosts", "PaddingCosts", "ONE_SEGMENT_HOST_SHARE", "fill_full", "load_padding_costs", "measure_call_costs",
    "measure_padding_costs", "median_ms", "save_padding_costs",
]

log = logging.getLogger(__name__)

REPEATS = 3


@dataclass(frozen=True)
class CallCosts:
    """Per budget (ascending): the bucket's replay and the compiled code at its sizes without a graph, in ms."""

    budgets: tuple[int, ...]
    replay_ms: tuple[float, ...]
    exact_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.budgets) == len(self.replay_ms) == len(self.exact_ms)) or list(self.budgets) != sorted(
            self.budgets
        ):
            raise ValueError("CallCosts needs one replay and one exact-size time per budget, budgets ascending")

    def replay(self, budget: int) -> float:
        return self.replay_ms[self.budgets.index(budget)]

    def exact(self, rows: int) -> float:
        """The compiled code's time without a graph at ``rows`` token rows: linear between the budgets around it
        (the smallest budget's time below it, the largest's slope above it)."""
        budgets, times = self.budgets, self.exact_ms
        if len(budgets) == 1 or rows <= budgets[0]:
            return times[0]
        upper = min(max(bisect.bisect_left(budgets, rows), 1), len(budgets) - 1)
        lower = upper - 1
        slope = (times[upper] - times[lower]) / (budgets[upper] - budgets[lower])
        return times[lower] + slope * (rows - budgets[lower])

    def format(self) -> str:
        return "\n".join(
            f"{budget:>8} replay {replay:8.3f} ms  exact size {exact:8.3f} ms"
            for budget, replay, exact in zip(self.budgets, self.replay_ms, self.exact_ms)
        )


EXACT_HOST_SHARE = 0.5
"""A call leaves its bucket's graph for the compiled code at its exact sizes only where that code's host time is at
most this share of the call's device time (as estimated below): its launches then run ahead of the GPU, which pays
no gaps. On an H200 an un-captured call of a released Qwen2-VL tower took 29 ms on the host, and one-image calls of
about 5,000 patches run so were slower than the stock tower (BENCHMARKS.md)."""
ONE_SEGMENT_HOST_SHARE = 0.8
"""A one-segment call whose exact runs' own host time is known (``serve/runtime``: its latest such run, launched
without waiting on the GPU) leaves the graph where that time is at most this share of its rows' share of the
bucket's one-segment replay: its launches then end before the replay would. The warm-up's launch time, of the
buckets' kernels at the smallest bucket, is not that run's: on an H200 a plain-install Qwen3-VL call of 7,056
patches took 37 ms to launch its one-segment kernels (dense cuDNN with its separation columns) where the warm-up
measured 16 ms, and ran at 56 ms where its replay took 42."""
EXACT_MIN_SAVING = 0.02
"""... and, for a call sent there for its padding alone, where its padding rows cost at least this share of its
own rows' work outside attention."""


@dataclass(frozen=True)
class PaddingCosts:
    """What the default choice weighs a call at its exact sizes against, per timed budget (ascending): the bucket's
    replay with random token rows and no segment (``empty_ms``: every row's work but attention, which the varlen
    kernels spare a padding row) and with one segment filling it (``full_ms``: a one-image call's work, attention
    included), and the host ms of one call of the compiled code with no graph (launching every kernel). Budgets
    too small to hide that launch are not timed."""

    budgets: tuple[int, ...]
    empty_ms: tuple[float, ...]
    full_ms: tuple[float, ...]
    exact_host_ms: float

    def _share_ms(self, times: tuple[float, ...], budget: int, rows: int) -> float | None:
        """``rows``' share of a timed replay of the bucket of ``budget`` (None where it was not timed)."""
        if budget not in self.budgets:
            return None
        return times[self.budgets.index(budget)] * rows / budget

    def one_segment_work(self, budget: int, rows: int) -> float | None:
        """A one-segment call's rows' share of the bucket's one-segment replay, in ms (None where untimed)."""
        return self._share_ms(self.full_ms, budget, rows)

    def launch_hides(self, work_ms: float | None, one_segment_host_ms: float | None = None) -> bool:
        """Whether the compiled code's host launches hide behind ``work_ms`` of a call's work at its exact sizes:
        the warm-up's launch time within ``EXACT_HOST_SHARE`` of it, or, where ``one_segment_host_ms`` (a
        one-segment exact run's own launch) is known, that time within ``ONE_SEGMENT_HOST_SHARE``."""
        if work_ms is None:
            return False
        if one_segment_host_ms is not None:
            return one_segment_host_ms <= ONE_SEGMENT_HOST_SHARE * work_ms
        return self.exact_host_ms <= EXACT_HOST_SHARE * work_ms

    def launch_hidden(self, budget: int, rows: int) -> bool:
        """Whether the warm-up's launch time hides (``launch_hides``) behind a call of ``rows`` rows at its exact
        sizes: behind its rows' work outside attention."""
        return self.launch_hides(self._share_ms(self.empty_ms, budget, rows))

    def exact_saves(self, budget: int, rows: int) -> bool:
        """Whether a call of ``rows`` rows runs faster at its exact sizes than padded to ``budget`` for its padding
        alone: its launches hide behind its rows' work outside attention and its padding rows' share of the bucket's
        work is worth it (``EXACT_MIN_SAVING``)."""
        if not self.launch_hidden(budget, rows):
            return False
        least = self._share_ms(self.empty_ms, budget, rows)
        return self.empty_ms[self.budgets.index(budget)] - least >= EXACT_MIN_SAVING * least

    def format(self) -> str:
        replays = ", ".join(
            f"{budget}: {empty:.3f} / {full:.3f}" for budget, empty, full in zip(self.budgets, self.empty_ms, self.full_ms)
        )
        return (
            f"exact-size launch {self.exact_host_ms:.3f} ms on the host; replays with no segment / one segment "
            f"filling the bucket (ms) {replays}"
        )


def measure_padding_costs(
    buckets: list[Bucket], run: Callable[[Bucket], object], exact: Callable[[list], object], spec: VarlenSpec,
    roles: dict[int, Role], device: torch.device,
) -> PaddingCosts:
    """Time the compiled code's host launch once (at the smallest bucket's sizes, no graph, no sync), then each
    bucket's replays (``PaddingCosts``), largest first, down to the first bucket whose one-segment replay could not
    hide those launches (the smaller ones cannot either)."""
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        fills.empty_bucket(buckets[0], roles)
        exact(list(buckets[0].inputs))  # first run: allocations, lazy loads
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        exact(list(buckets[0].inputs))
        host_ms = (time.perf_counter() - begin) * 1e3
        empty, full = {}, {}
        for bucket in sorted(buckets, key=lambda bucket: -bucket.shape.budget):
            budget = bucket.shape.budget
            _random_tokens(bucket, roles, generator)
            empty[budget] = median_ms(lambda: run(bucket), device, repeats=1)
            fill_full(bucket, spec, roles, generator)
            full[budget] = median_ms(lambda: run(bucket), device, repeats=1, warm=False)
            if host_ms > EXACT_HOST_SHARE * full[budget]:
                break
    budgets = tuple(sorted(empty))
    costs = PaddingCosts(budgets, tuple(empty[b] for b in budgets), tuple(full[b] for b in budgets), host_ms)
    log.info("padding costs measured at warm-up: %s", costs.format())
    return costs


def _padding_costs_path() -> str:
    return json_cache.cache_path("vgraph_padding_costs.json")


def load_padding_costs(key: str) -> PaddingCosts | None:
    """The padding costs saved under ``key`` (module docstring), or None (never saved, or unreadable)."""
    saved = json_cache.load(_padding_costs_path()).get(key)
    try:
        return PaddingCosts(**{name: tuple(v) if isinstance(v, list) else v for name, v in saved.items()})
    except (AttributeError, TypeError):
        return None


def save_padding_costs(key: str, costs: PaddingCosts) -> None:
    """Save ``costs`` under ``key`` (merged into the file, replaced atomically)."""
    json_cache.merge(_padding_costs_path(), {key: dataclasses.asdict(costs)})


def _random_tokens(bucket: Bucket, roles: dict[int, Role], generator: torch.Generator) -> None:
    """Fill ``bucket`` as a call with no tokens, but with random values in its floating token rows, drawn on the
    generator's device (the buckets' own at warm-up: on the host, a 16,384-row bucket's pixel rows of 1,536 values
    take 0.15 s to draw on two cores, before the copy, and the padding costs draw every timed bucket's twice)."""
    fills.empty_bucket(bucket, roles)
    for index, buffer in bucket.buffers.items():
        if roles[index] is Role.TOKENS and buffer.is_floating_point():
            buffer.copy_(torch.randn(buffer.shape, generator=generator, device=generator.device).to(buffer.dtype))


def fill_full(bucket: Bucket, spec: VarlenSpec, roles: dict[int, Role], generator: torch.Generator) -> None:
    """Fill ``bucket`` as its costliest call (module docstring): random token rows, each group that ends at its
    rows cut into segments of the bucket's ``max_seqlen``, the rest as for a call with no tokens. A group whose
    offsets are a graph input but whose end the analysis did not tie to a row count (an HF tower's ``cu_seqlens``,
    made from the grid on the host) gets one segment of ``max_seqlen`` rows, which no bucket's rows fall short of:
    without it the "full" replay would run no attention at all."""
    _random_tokens(bucket, roles, generator)
    for group, length in zip(spec.groups, bucket.shape.max_seqlen):
        offsets = bucket.buffers.get(group.offsets_input)
        if offsets is None or roles[group.offsets_input] is not Role.SEGMENT_OFFSETS:
            continue
        rows = length if group.ends_at is None else evaluate(group.ends_at, bucket.shape.values, "a group's rows")
        full = (torch.arange(offsets.shape[0], dtype=torch.int64) * length).clamp(max=rows)
        offsets.copy_(full.to(offsets.dtype))


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = REPEATS, warm: bool = True) -> float:
    """The median time of ``repeats`` runs of ``fn`` (after one warm run unless ``warm`` is False), in ms (CUDA
    events on CUDA)."""
    if warm:
        fn()  # lazy loading, allocator
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def measure_call_costs(
    buckets: list[Bucket],
    run: Callable[[Bucket], object],
    exact: Callable[[list], object],
    spec: VarlenSpec,
    roles: dict[int, Role],
    device: torch.device,
) -> CallCosts:
    """Time ``run(bucket)`` (its replay) and ``exact(list(bucket.inputs))`` (the compiled code, no graph) for every
    bucket, each filled full."""
    generator = torch.Generator(device).manual_seed(0)
    replay_ms, exact_ms = [], []
    with torch.no_grad():
        for bucket in buckets:
            fill_full(bucket, spec, roles, generator)
            replay_ms.append(median_ms(lambda: run(bucket), device))
            exact_ms.append(median_ms(lambda: exact(list(bucket.inputs)), device))
    costs = CallCosts(tuple(b.shape.budget for b in buckets), tuple(replay_ms), tuple(exact_ms))
    log.info("call costs measured at warm-up (ms):\n%s", costs.format())
    return costs
