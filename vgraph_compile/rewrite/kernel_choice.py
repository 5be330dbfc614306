"""``attention_backend="auto"`` on CUDA: each attention group's kernel, per bucket, chosen by timing the installed
ones.

No kernel wins every shape: cuDNN's ragged attention is ~1.5x FlashAttention-2 on long full-attention segments
and slower on 64-row windows (BENCHMARKS.md), and one dense SDPA call over a bucket that one large image fills
(``kernels/dense.py``: the kernel the stock tower runs) beats every varlen kernel there and wastes quadratic work
on a bucket of many small images. So each attention group (full attention, window attention) of each bucket gets
its own kernel: every installed kernel that runs on the device and dtype is timed on that group's shape in that
bucket (its rows split into segments of the group's max_seqlen, the offsets padded to the bucket's segment
capacity with empty segments, as a full call leaves them) as it is served: the op's call, with whatever the kernel
needs around it (the NaN/Inf confinement, head_dim padding and the dense kernels' separation columns, all counted),
captured in a CUDA graph and replayed a few times, so a kernel's host-side launch cost, which replays do not pay,
does not count. The fastest is kept. A kernel that fails on the shape is skipped with its reason logged. The
compiled graph is one for all buckets: a group whose buckets chose different kernels names them all in one
``backend`` argument (``registry.by_rows``), and the op picks by its rows when each bucket is captured.

The timings are cached in ``vgraph_kernels.json`` under inductor's cache directory, keyed by device, torch
version, kernels and shape: a second start with the same model and GPU does not time again.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from vgraph_compile.kernels import registry
from vgraph_compile.fx_utils import example_value
from vgraph_compile.symbolic import evaluate
from vgraph_compile.spec import PassContext

__all__ = ["choose_kernels", "fastest_kernel", "group_offsets", "GroupShape"]

log = logging.getLogger(__name__)

_REPEATS = 5


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
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "vgraph_kernels.json")


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


def choose_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[int, str]:
    """Attention group -> its kernel per bucket (``registry.by_rows``; a plain name where every bucket chose the
    same), timed on CUDA for ``attention_backend="auto"``; empty otherwise."""
    if ctx.config.attention_backend != "auto" or ctx.device.type != "cuda" or not ctx.buckets:
        return {}
    path = _cache_path()
    cache = load_timings(path)
    chosen = {}
    for group, by_rows in _group_shapes(gm, ctx).items():
        fastest = {}
        for rows, shape in by_rows.items():
            names = _candidates(ctx.device, shape.dtype)
            if len(names) < 2:
                break
            kernel = fastest_kernel(
                shape.key(ctx.device, names), names, cache, lambda name: _time_ms(name, shape, ctx.device)
            )
            if kernel is None:
                break
            fastest[rows] = kernel
        if fastest and len(fastest) == len(by_rows):
            chosen[group] = registry.by_rows(fastest)
            log.info("attention group %d: %s", group, chosen[group])
    save_timings(path, cache)
    return chosen


def load_timings(path: str) -> dict:
    """The cached kernel timings (empty when the file is missing or unreadable)."""
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def save_timings(path: str, timings: dict) -> None:
    """Merge ``timings`` into the file, replaced atomically: processes starting together (one per rank) neither
    read a half-written file nor drop each other's entries, except a key both timed (the last write wins)."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        merged = {**load_timings(path), **timings}
        handle, scratch = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(merged, file, indent=1)
        os.replace(scratch, path)
    except OSError as failure:
        log.info("kernel timings not cached: %s", failure)
