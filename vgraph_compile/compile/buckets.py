"""Per bucket: persistent input buffers and, on CUDA, one captured graph of the compiled code.

Lifecycle (``capture``, one bucket; ``CompiledEncoder`` orders them, largest first, into one memory pool, so later
captures reuse the memory of the first): fill its buffers as for a call with no tokens, run the compiled code once
on a side stream (warm-up: lazy kernel loading, allocator state), then record one ``torch.cuda.CUDAGraph`` and
upload it to the device (so the first call served by it does not pay the upload). Its
outputs are static tensors in the pool that each replay overwrites; the runtime copies out what it returns. A
capture that runs out of memory drops that bucket with a warning; the encoder keeps the others. Every graph is
kept alive as long as the pool (a pool freed with its last graph breaks the next capture into it).

Buffers: each copied token input (``Role.TOKENS``) has one flat storage, sized for the largest bucket; a bucket's
buffer is a contiguous view of its first elements. The other copied inputs (offsets, indices: the metadata)
share one byte storage: a bucket's metadata buffers are typed views laid one after another (each at a multiple
of ``STAGE_ALIGNMENT`` bytes) from its start, so a bucket's metadata is one contiguous byte ``region``, which a
call whose metadata was seen before fills with one copy of its staged bytes (``serve/fills``). Buckets never run
at the same time (the runtime serializes calls), so they share both storages. On CPU (or with
``cudagraphs=False``) a bucket runs the compiled code on its buffers each call.

What this module does not own: filling the buffers (``serve/fills``: per call, and empty before a capture, which
``capture`` takes as its ``prepare``), choosing a bucket, and the order of calls (``serve/runtime``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from vgraph_compile.compile.inductor import CompiledFn
from vgraph_compile.counters import counters
from vgraph_compile.symbolic import evaluate
from vgraph_compile.spec import BucketShape, Role, VarlenSpec

__all__ = [
    "Bucket", "BucketStats", "allocate", "capture", "padded_fraction", "pool_bytes", "upload", "STAGE_ALIGNMENT"
]

log = logging.getLogger(__name__)

STAGE_ALIGNMENT = 64
"""Byte alignment of each metadata buffer in a bucket's region (compiled kernels assume 16-byte aligned inputs)."""


@dataclass
class BucketStats:
    budget: int
    hits: int = 0
    real_tokens: int = 0
    """Sum over hits of the real token rows."""

    @property
    def padded_fraction(self) -> float:
        """Share of the bucket's rows that were padding, over its hits."""
        return padded_fraction([self])


def padded_fraction(stats) -> float:
    """Share of the rows that were padding, over every hit of these buckets."""
    stats = list(stats)
    capacity = sum(bucket.hits * bucket.budget for bucket in stats)
    return 1.0 - sum(bucket.real_tokens for bucket in stats) / capacity if capacity else 0.0


@dataclass
class Bucket:
    """One token budget: the graph inputs at its sizes, and its captured graph once ``capture`` ran."""

    shape: BucketShape
    inputs: list[Any]
    """Every graph input at this bucket's sizes: buffers (views), bound parameters, size ints."""
    buffers: dict[int, torch.Tensor]
    """The inputs filled per call, by graph input index."""
    stats: BucketStats
    region: torch.Tensor | None = None
    """The bytes of every metadata buffer (all but the token inputs), contiguous; None when there are none."""
    tokens: frozenset[int] = frozenset()
    """Graph input indices of the token buffers (those outside ``region``)."""
    graph: "torch.cuda.CUDAGraph | None" = None
    outputs: Sequence[Any] = field(default_factory=tuple)
    """The captured graph's output tensors (overwritten by each replay)."""

    def run(self, compiled: CompiledFn) -> Sequence[Any]:
        """Replay the captured graph, or run the compiled code on the buffers."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return compiled(list(self.inputs))


def allocate(
    spec: VarlenSpec,
    shapes: list[BucketShape],
    bound: list[Any],
    copied: dict[int, tuple[torch.dtype, torch.device]],
    int_inputs: dict[int, Any],
) -> list[Bucket]:
    """Buckets (smallest first) over shared storages: one per copied token input, one for all the metadata.

    ``bound`` holds the inputs fixed for every bucket (parameters; None elsewhere); ``copied`` gives the dtype and
    device of each input filled per call; ``int_inputs`` maps each size input to its symbolic value, evaluated at
    each bucket's sizes.
    """
    shapes = sorted(shapes, key=lambda shape: shape.budget)
    sizes = {
        index: [
            [evaluate(size, shape.values, "a buffer's size") for size in spec.input_shapes[index]] for shape in shapes
        ]
        for index in copied
    }
    tokens = {index: copied[index] for index in copied if spec.inputs[index].role is Role.TOKENS}
    metadata = [index for index in copied if index not in tokens]
    storages = {
        index: torch.empty(max(math.prod(dims) for dims in sizes[index]), dtype=dtype, device=device)
        for index, (dtype, device) in tokens.items()
    }
    layouts = [
        _region_layout(metadata, copied, [sizes[index][position] for index in metadata])
        for position in range(len(shapes))
    ]
    region_bytes = max((end for _, end in layouts), default=0)
    device = next((device for _, device in copied.values()), None)
    region_storage = torch.empty(region_bytes, dtype=torch.uint8, device=device) if metadata else None
    buckets = []
    for position, shape in enumerate(shapes):
        inputs = list(bound)
        buffers = {}
        for index, storage in storages.items():
            dims = sizes[index][position]
            buffers[index] = storage[: math.prod(dims)].view(dims)
        offsets, end = layouts[position]
        for index in metadata:
            dims, (dtype, _) = sizes[index][position], copied[index]
            start = offsets[index]
            nbytes = math.prod(dims) * dtype.itemsize
            buffers[index] = region_storage[start : start + nbytes].view(dtype).view(dims)
        for index in copied:
            inputs[index] = buffers[index]
        for index, value in int_inputs.items():
            inputs[index] = evaluate(value, shape.values, "a size input")
        region = region_storage[:end] if region_storage is not None else None
        buckets.append(Bucket(shape, inputs, buffers, BucketStats(shape.budget), region, frozenset(tokens)))
    return buckets


def _region_layout(
    metadata: list[int], copied: dict[int, tuple[torch.dtype, torch.device]], dims: list[list[int]]
) -> tuple[dict[int, int], int]:
    """Each metadata buffer's byte offset in a bucket's region, and the region's end (``STAGE_ALIGNMENT``)."""
    offsets, end = {}, 0
    for index, shape in zip(metadata, dims):
        offsets[index] = end
        end += math.ceil(math.prod(shape) * copied[index][0].itemsize / STAGE_ALIGNMENT) * STAGE_ALIGNMENT
    return offsets, end


def pool_bytes(pool: tuple[int, int] | None = None) -> int:
    """Device bytes the caching allocator holds in the private pool ``pool`` (a ``graph_pool_handle``), or in
    every private pool (every CUDA graph's) if None; the general cache is not counted."""
    total = 0
    for segment in torch.cuda.memory_snapshot():
        owner = tuple(segment.get("segment_pool_id", (0, 0)))
        if owner != (0, 0) and (pool is None or owner == tuple(pool)):
            total += segment["total_size"]
    return total


@functools.cache
def _driver() -> "ctypes.CDLL | None":
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def upload(graph: "torch.cuda.CUDAGraph") -> bool:
    """Upload a captured graph to the device now (``cuGraphUpload``; torch has no binding for it), so its first
    replay costs what every later one does, not the upload (0.34-0.41 ms of host time on the H200 for a 400-kernel
    graph, against 0.01-0.02 ms uploaded; ``benchmarks/graph_replay.py``). False (the first replay uploads) where
    the driver library or ``raw_cuda_graph_exec`` is missing, or the driver refuses."""
    driver = _driver()
    if driver is None or not hasattr(graph, "raw_cuda_graph_exec"):
        return False
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    result = driver.cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()), stream)
    if result != 0:
        log.debug("cuGraphUpload returned %s; the graph uploads at its first replay", result)
    return result == 0


def capture(
    bucket: Bucket,
    compiled: CompiledFn,
    pool: tuple[int, int],
    prepare: Callable[[Bucket], None],
    error_mode: str = "global",
) -> bool:
    """Record ``bucket``'s CUDA graph into ``pool`` after ``prepare(bucket)`` filled its buffers as for a call with
    no tokens and one warm-up run on a side stream; False (nothing kept) where the device ran out of memory.
    ``error_mode``: CUDA's capture mode, ``"thread_local"`` where other threads keep working on the device during
    the capture (captures behind served calls)."""
    side = torch.cuda.Stream()
    prepare(bucket)
    try:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            compiled(list(bucket.inputs))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode), torch.no_grad():
            outputs = compiled(list(bucket.inputs))
    except torch.OutOfMemoryError:
        log.warning(
            "budget %d dropped: out of GPU memory while capturing its graph; calls it would serve use the next "
            "larger bucket or run eagerly",
            bucket.shape.budget,
        )
        counters.buckets_dropped += 1
        return False
    counters.graphs_uploaded += upload(graph)
    bucket.graph, bucket.outputs = graph, outputs
    counters.graphs_captured += 1
    return True
