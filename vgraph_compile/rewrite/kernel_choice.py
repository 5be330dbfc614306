"""``attention_backend="auto"`` on CUDA: each attention group's kernel, per bucket, chosen by timing the installed
ones.

No kernel wins every shape: cuDNN's ragged attention is ~1.5x FlashAttention-2 on long full-attention segments
and slower on 64-row windows (BENCHMARKS.md), and one dense SDPA call over one large image (``kernels/dense.py``:
the kernel the stock tower runs) beats FlashAttention-2 there and wastes quadratic work on the rows of any other
segment or padding. So each attention group (full attention, window attention) of each bucket gets its own kernel:
every installed kernel whose work follows the segments (and a dense one where the bucket holds one segment slot)
that runs on the device and dtype is timed on that group's shape in that bucket (its rows split into segments of the group's max_seqlen, the offsets padded to the bucket's segment
capacity with empty segments, as a full call leaves them) as it is served: the op's call, with whatever the kernel
needs around it (the NaN/Inf confinement, head_dim padding and the dense kernels' separation columns, all counted),
captured in a CUDA graph and replayed a few times, so a kernel's host-side launch cost, which replays do not pay,
does not count. The fastest is kept. A kernel that fails on the shape is skipped with its reason logged. The
compiled graph is one for all buckets: a group whose buckets chose different kernels names them all in one
``backend`` argument (``registry.by_rows``), and the op picks by its rows when each bucket is captured.

A call of one image is not charged for a bucket's other slots either: for the full-attention buckets, one segment
filling the bucket is timed on every kernel, dense ones included, and where another kernel saves at least
``EXACT_WORTH_MS`` over the group's sites it becomes the group's one-segment entry; the runtime serves such calls
at their exact sizes (no padding rows, the offsets one segment long), where the op picks that entry, when that
run's host launch hides behind the call's work (``serve/call_costs.PaddingCosts``).

The timings are cached in ``vgraph_kernels.json`` under inductor's cache directory, keyed by device, torch
version, kernels and shape: a second start with the same model and GPU does not time again.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from vgraph_compile import json_cache
from vgraph_compile.kernels import registry
from vgraph_compile.fx_utils import example_value
from vgraph_compile.symbolic import evaluate
from vgraph_compile.spec import PassContext

__all__ = ["choose_kernels", "group_kernels", "fastest_kernel", "group_offsets", "GroupShape", "EXACT_WORTH_MS"]

log = logging.getLogger(__name__)

_REPEATS = 5

EXACT_WORTH_MS = 1.0
"""The least a one-segment call's kernel must save over a group's sites to get an entry of its own (timing noise
below it). A call takes that entry only at its exact sizes, with no graph, and the runtime sends it there only where
that run's host launch hides behind the call's work (``serve/call_costs.PaddingCosts``, measured at warm-up)."""


@dataclass(frozen=True)
class GroupShape:
    """What a group's kernel is timed on: rows, split into segments of ``segment`` rows, the offsets padded to
    ``capacity`` segments."""

    rows: int
    segment: int
    capacity: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def key(self, device: torch.device, kernels: list[str]) -> str:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name}|torch {torch.__version__}|graph replay|{','.join(kernels)}|{self.rows}x{self.heads}x{self.head_dim}"
            f"/{self.segment}x{self.capacity}|{self.dtype}"
        )


def _candidates(device: torch.device, dtype: torch.dtype) -> list[str]:
    return [
        name
        for name, backend in registry.BACKENDS.items()
        if not backend.qkv_offsets and backend.timed_by_auto and backend.available(device, dtype)
    ]


def _time_ms(name: str, shape: GroupShape, device: torch.device) -> float:
    from vgraph_compile.kernels.ops import varlen_attention

    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape.rows, shape.heads, shape.head_dim, device=device, dtype=shape.dtype, generator=generator)
        for _ in range(3)
    )
    cu = group_offsets(shape).to(device)
    for _ in range(2):  # JIT compiles and plans, outside the capture
        varlen_attention(q, k, v, cu, shape.segment, backend=name)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        varlen_attention(q, k, v, cu, shape.segment, backend=name)
    graph.replay()
    times = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def group_offsets(shape: GroupShape) -> torch.Tensor:
    """The offsets a full call leaves: segments of ``shape.segment`` rows up to ``shape.rows``, then empty segments
    (the last offset repeated) up to ``shape.capacity``."""
    full = torch.arange(0, shape.rows + shape.segment, shape.segment, dtype=torch.int64).clamp(max=shape.rows)
    full = torch.unique_consecutive(full)
    capacity = max(shape.capacity, full.shape[0] - 1)
    return torch.cat([full, full[-1:].expand(capacity + 1 - full.shape[0])]).to(torch.int32)


def fastest_kernel(key: str, names: list[str], cache: dict, time_ms: Callable[[str], float]) -> str | None:
    """The kernel with the least time for ``key``: from ``cache``, or timed with ``time_ms`` and cached. A kernel
    whose timing raises is skipped (logged); None when none ran."""
    if key not in cache:
        timings = {}
        for name in names:
            try:
                timings[name] = time_ms(name)
            except Exception as failure:  # a kernel that cannot run this shape is skipped, never chosen
                log.warning("kernel %s skipped for %s: %s", name, key, failure)
        cache[key] = timings
    timings = cache[key]
    log.info("kernel timings for %s (ms): %s", key, timings)
    return min(timings, key=timings.get) if timings else None


def _cache_path() -> str:
    return json_cache.cache_path("vgraph_kernels.json")


def _group_shapes(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[int, dict[int, GroupShape]]:
    """Attention group -> {the rows of its attention call in a bucket: its shape there}, for every bucket."""
    nodes = {node.name: node for node in gm.graph.nodes}
    shapes: dict[int, dict[int, GroupShape]] = {}
    for site in ctx.spec.sites:
        if site.group in shapes:
            continue
        q = example_value(nodes[site.node].args[0])
        shapes[site.group] = {}
        for bucket in ctx.buckets:
            rows = evaluate(site.rows, bucket.values, f"the rows of attention site {site.node}")
            segment = max(1, min(rows, bucket.max_seqlen[site.group]))
            shape = GroupShape(rows, segment, bucket.segments[site.group], int(q.shape[1]), int(q.shape[2]), q.dtype)
            shapes[site.group][rows] = shape
    return shapes


TimeMs = Callable[[str, GroupShape], float]
"""A kernel's time on a shape, in ms (``_time_ms`` on the build's device)."""
ShapeKey = Callable[[GroupShape, list[str]], str]
"""The cache key of a shape timed among kernels (``GroupShape.key`` on the build's device)."""


def _one_segment_kernel(
    shape: GroupShape, kernel: str, names: list[str], sites: int, time_ms: TimeMs, cache: dict, key: ShapeKey
) -> str:
    """The kernel for a call whose offsets hold one segment of ``shape.rows`` rows, where ``kernel`` serves the
    bucket: another (a ``whole_rows`` kernel, say) only where it saves at least ``EXACT_WORTH_MS`` over the
    group's ``sites``."""
    single = GroupShape(shape.rows, shape.rows, 1, shape.heads, shape.head_dim, shape.dtype)
    timings = cache.setdefault(key(single, names), {})

    def time(name: str) -> None:
        if name in timings:
            return
        try:
            timings[name] = time_ms(name, single)
        except Exception as failure:  # a kernel that cannot run this shape is never chosen for it
            log.warning("kernel %s skipped for %s: %s", name, key(single, names), failure)
            timings[name] = float("inf")

    time(kernel)
    if timings[kernel] * sites >= EXACT_WORTH_MS:  # else no kernel could save enough: time no other
        for name in names:
            time(name)
    log.info("kernel timings for %s (ms): %s", key(single, names), timings)
    fastest = min(timings, key=timings.get)
    return fastest if (timings[kernel] - timings[fastest]) * sites >= EXACT_WORTH_MS else kernel


AGREEING_SPAN = 4.0
"""The widest stretch of buckets (its largest over its smallest, in rows) whose inner buckets take the kernels
both its ends chose without being timed (``group_kernels``)."""


def group_kernels(
    by_rows: dict[int, GroupShape], names: list[str], sites: int, time_ms: TimeMs, cache: dict, key: ShapeKey
) -> str | None:
    """One attention group's kernels (``registry.by_rows``) among ``names``, the group having ``sites`` attention
    calls; None when some bucket has no kernel that runs.

    A bucket's kernel is the fastest on the bucket's full shape among the kernels whose work follows the segments
    (a ``whole_rows`` kernel too where the bucket holds one segment slot). Where a segment can fill the bucket (full
    attention), a call of one segment of the bucket's rows gets its own entry (``_one_segment_kernel``).

    Timed once per stretch of agreeing buckets, by bisection: the smallest and the largest bucket are timed; a
    stretch whose two ends are of one kind (one slot or several, a one-segment entry or not) with every bucket
    between, chose the same kernels, and span at most ``AGREEING_SPAN`` in rows gives its inner buckets their
    kernels untimed; any other stretch is cut at its middle bucket, which is timed (a kernel's time follows the
    rows smoothly: the fastest does not change inside a short stretch whose ends agree). On an H200 the 29 default
    budgets of a Qwen tower took 10-11 s of kernel timing at a cold start when each was timed, and 60 s for
    Qwen2.5-VL's two groups in the GPU install with every other one timed (each new shape compiles FlashAttention-4
    and builds cuDNN plans); with one kind and one choice throughout, six of the 29 are timed."""
    ordered = sorted(by_rows)
    many: dict[int, str] = {}
    one: dict[int, str] = {}

    def kind(rows: int) -> tuple[bool, bool]:
        shape = by_rows[rows]
        return shape.capacity == 1, shape.capacity > 1 and shape.segment >= rows and len(names) > 1

    def choose(rows: int) -> bool:
        shape = by_rows[rows]
        per_segment = [name for name in names if shape.capacity == 1 or not registry.BACKENDS[name].whole_rows]
        if len(per_segment) > 1:
            kernel = fastest_kernel(key(shape, per_segment), per_segment, cache, lambda name: time_ms(name, shape))
        else:
            kernel = per_segment[0] if per_segment else None
        if kernel is None:
            return False
        many[rows] = one[rows] = kernel
        if kind(rows)[1]:
            one[rows] = _one_segment_kernel(shape, kernel, names, sites, time_ms, cache, key)
        return True

    def settle(low: int, high: int) -> bool:
        """Kernels for the buckets strictly between ``ordered[low]`` and ``ordered[high]`` (both chosen)."""
        if high - low < 2:
            return True
        first, last, inner = ordered[low], ordered[high], ordered[low + 1 : high]
        agree = (
            last <= AGREEING_SPAN * first
            and all(kind(rows) == kind(first) for rows in (*inner, last))
            and (many[first], one[first]) == (many[last], one[last])
        )
        if agree:
            for rows in inner:
                many[rows], one[rows] = many[first], one[first]
            return True
        middle = (low + high) // 2
        return choose(ordered[middle]) and settle(low, middle) and settle(middle, high)

    if not (choose(ordered[0]) and (len(ordered) == 1 or choose(ordered[-1]))):
        return None
    if not settle(0, len(ordered) - 1):
        return None
    return registry.by_rows(many, one)


def choose_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[int, str]:
    """Attention group -> its kernels (``group_kernels``; a plain name where every bucket and every one-segment
    call chose the same), timed on CUDA for ``attention_backend="auto"``; empty otherwise."""
    if ctx.config.attention_backend != "auto" or ctx.device.type != "cuda" or not ctx.buckets:
        return {}
    path = _cache_path()
    cache = json_cache.load(path)
    sites = collections.Counter(site.group for site in ctx.spec.sites)
    chosen = {}
    for group, by_rows in _group_shapes(gm, ctx).items():
        names = _candidates(ctx.device, next(iter(by_rows.values())).dtype)
        if len(names) < 2:
            continue
        kernels = group_kernels(
            by_rows,
            names,
            sites[group],
            lambda name, shape: _time_ms(name, shape, ctx.device),
            cache,
            lambda shape, names: shape.key(ctx.device, names),
        )
        if kernels is not None:
            chosen[group] = kernels
            log.info("attention group %d: %s", group, kernels)
    json_cache.merge(path, cache)
    return chosen
