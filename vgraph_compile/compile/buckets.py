"""Per bucket: persistent input buffers and, on CUDA, one captured graph of the compiled code.

Lifecycle (``capture``): buckets are captured largest first into one memory pool, so every later capture reuses
the memory of the first. For each: fill its buffers as for a call with no tokens, run the compiled code once
on a side stream (warm-up: lazy kernel loading, allocator state), then record one ``torch.cuda.CUDAGraph``. Its
outputs are static tensors in the pool that each replay overwrites; the runtime copies out what it returns. A
capture that runs out of memory drops that bucket with a warning; the encoder keeps the others. Every graph is
kept alive as long as the pool (a pool freed with its last graph breaks the next capture into it).

Buffers: each copied input has one flat storage, sized for the largest bucket; a bucket's buffer is a contiguous
view of its first elements. Buckets never run at the same time (the runtime serializes calls), so they share it.
On CPU (or with ``cudagraphs=False``) a bucket runs the compiled code on its buffers each call.

What this module does not own: filling the buffers per call (``compile/padding``, called by ``serve/runtime``),
choosing a bucket, and the order of calls (``serve/runtime``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from vgraph_compile.compile.inductor import CompiledFn
from vgraph_compile.counters import counters
from vgraph_compile.symbolic import evaluate
from vgraph_compile.spec import BucketShape, Role, VarlenSpec
from vgraph_compile.compile import padding

__all__ = ["Bucket", "BucketStats", "allocate", "capture", "padded_fraction"]

log = logging.getLogger(__name__)


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
    fills: tuple[tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.Tensor, int], ...] = ()
    """Per buffer: its role's padding rule, the buffer and its graph input index (looked up once, not per call)."""
    graph: "torch.cuda.CUDAGraph | None" = None
    outputs: Sequence[Any] = field(default_factory=tuple)
    """The captured graph's output tensors (overwritten by each replay)."""

    def run(self, compiled: CompiledFn) -> Sequence[Any]:
        """Replay the captured graph, or run the compiled code on the buffers."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return compiled(list(self.inputs))

    def fill(self, args: Sequence[Any], written: Mapping[int, int]) -> None:
        """Fill every buffer from a call's graph inputs by its role's rule (``padding``); ``written`` gives, per
        input of ``padding.WRITTEN_SIZE_ROLES``, the call's real size of the dim it writes (``CallPlan.written``)."""
        for rule, buffer, index in self.fills:
            if index in written:
                rule(buffer, args[index], written[index])
            else:
                rule(buffer, args[index])

    def fill_empty(self, roles: dict[int, Role]) -> None:
        """Fill every buffer as for a call with no tokens (valid input for any kernel)."""
        for index, buffer in self.buffers.items():
            padding.fill_empty(roles[index], buffer)


def allocate(
    spec: VarlenSpec,
    shapes: list[BucketShape],
    bound: list[Any],
    copied: dict[int, tuple[torch.dtype, torch.device]],
    int_inputs: dict[int, Any],
) -> list[Bucket]:
    """Buckets (smallest first) over shared flat storages, one per copied input.

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
    storages = {
        index: torch.empty(max(math.prod(dims) for dims in sizes[index]), dtype=dtype, device=device)
        for index, (dtype, device) in copied.items()
    }
    buckets = []
    for position, shape in enumerate(shapes):
        inputs = list(bound)
        buffers = {}
        for index, storage in storages.items():
            dims = sizes[index][position]
            buffers[index] = inputs[index] = storage[: math.prod(dims)].view(dims)
        for index, value in int_inputs.items():
            inputs[index] = evaluate(value, shape.values, "a size input")
        fills = tuple((padding.RULES[spec.inputs[index].role], buffer, index) for index, buffer in buffers.items())
        buckets.append(Bucket(shape, inputs, buffers, BucketStats(shape.budget), fills))
    return buckets


def capture(buckets: list[Bucket], compiled: CompiledFn, roles: dict[int, Role]) -> list[Bucket]:
    """Record one CUDA graph per bucket, largest first, into one pool; returns the buckets captured."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    captured = []
    largest_first = sorted(buckets, key=lambda bucket: -bucket.shape.budget)
    for bucket in tqdm(largest_first, desc="vgraph: capturing", unit="graph", leave=False):
        bucket.fill_empty(roles)
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                compiled(list(bucket.inputs))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                outputs = compiled(list(bucket.inputs))
        except torch.OutOfMemoryError:
            log.warning(
                "budget %d dropped: out of GPU memory while capturing its graph; calls it would serve use the "
                "next larger bucket or run eagerly",
                bucket.shape.budget,
            )
            counters.buckets_dropped += 1
            continue
        bucket.graph, bucket.outputs = graph, outputs
        counters.graphs_captured += 1
        captured.append(bucket)
    return sorted(captured, key=lambda bucket: bucket.shape.budget)
