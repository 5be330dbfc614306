"""Assembly, the pipeline's last stage: the compiled code bound into an encoder with its buckets' buffers.

``assemble`` binds the parameters (padded where ``align_matmuls`` asked, sharing the module's storage), prepares
the kernels' state and allocates every bucket's buffers. ``CompiledEncoder.warmup(prepare)`` captures the CUDA
graphs (on the first call; ``prepare`` is the serving stage's empty fill). The runtime only validates, fills,
replays and narrows.

What the earlier stages decided is a picklable ``BuildRecord``: a later process that loaded it
(``entry/warm_start``) and the compiled code (``compile/artifacts``) calls ``assemble`` itself, with no trace and
no compile.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary
from tqdm.auto import tqdm

from vgraph_compile.kernels import registry
from vgraph_compile.compile import buckets as bucket_graphs
from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.compile.inductor import CompiledFn
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.rewrite.align_matmuls import PADDED_SHAPE
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import BucketShape, DroppedBucket, PassContext, Role, VarlenSpec

__all__ = ["assemble", "BuildRecord", "CompiledEncoder", "InputLayout", "cudagraphs_wanted", "input_layout"]

log = logging.getLogger(__name__)

_ALIGNED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
"""Module parameter -> a weak reference to the aligned tensor that owns its storage (``_aligned``)."""


@dataclass(frozen=True)
class InputLayout:
    """How each graph input enters the buckets, by graph input index (saved with a build plan)."""

    copied: dict[int, tuple[torch.dtype, torch.device]]
    """Inputs filled per call: their buffers' dtype and device."""
    sizes: dict[int, Any]
    """Size inputs: their value in the trace's symbols, evaluated at each bucket's sizes."""
    constants: dict[int, Any]
    """Other non-tensor inputs: their traced value."""
    padded: dict[int, tuple[int, ...]]
    """Parameters ``align_matmuls`` pads: their aligned shape."""


def input_layout(gm: torch.fx.GraphModule, spec: VarlenSpec) -> InputLayout:
    """How each input of the graph to compile (rewritten) enters the buckets."""
    copied, sizes, constants, padded = {}, {}, {}, {}
    for role, node in zip(spec.inputs, gm.graph.find_nodes(op="placeholder")):
        value = example_value(node)
        if role.role is Role.PARAMETER:
            if node.meta.get(PADDED_SHAPE) is not None:
                padded[role.index] = tuple(node.meta[PADDED_SHAPE])
        elif isinstance(value, torch.Tensor):
            copied[role.index] = (value.dtype, value.device)
        elif isinstance(value, torch.SymInt):
            sizes[role.index] = value.node.expr
        else:
            constants[role.index] = value
    return InputLayout(copied, sizes, constants, padded)


@dataclass(frozen=True)
class BuildRecord:
    """What the build decided for one trace, besides the compiled code and the buffers; picklable."""

    eager: torch.fx.GraphModule
    """The trace with the configured kernels, run as is for calls no bucket serves."""
    layout: InputLayout
    shapes: tuple[BucketShape, ...]
    """The buckets the compiled code serves."""
    cudagraphs: bool
    kernels: dict[int, str]
    """Attention group -> the kernel its sites run."""
    folded: dict[int, float | int | bool]
    """Graph input index -> the scalar value the graphs were built with (``rewrite/fold_scalars``)."""
    prepared: tuple[tuple[str, str], ...]
    """(kernel, device) of each kernel the compiled graph calls, whose state ``assemble`` prepares."""
    artifact_key: str | None
    """The saved artifact holding the compiled code (``compile/artifacts``); None when it is not on disk."""
    graph: torch.fx.GraphModule | None
    """The rewritten graph itself when it runs as is (``compiler="eager"``); None when inductor compiled it."""
    dropped: tuple[DroppedBucket, ...] = ()
    """Budgets the analyses and the compile gave up, with their reasons."""
    size_guards: tuple | None = None
    """The trace's and the compile's size guards (``compile/inductor.size_guards``): the compiled code may run at a
    call's exact sizes, with no bucket, where all hold; None: unknown, never run so."""


@dataclass
class CompiledEncoder:
    """What the build made of one trace; the runtime serves calls from it."""

    record: BuildRecord
    compiled: CompiledFn
    """The graph compiled once, symbolic in every token and segment size."""
    buckets: list[Bucket]
    """Smallest budget first."""
    roles: dict[int, Role]
    """Role of each input filled per call, by graph input index."""
    pool_bytes: int = 0
    """Device memory the graphs' shared pool holds after every capture."""
    captured: bool = False
    """Whether ``warmup`` ran (the buckets list is final); buckets may hold graphs before (``capture_one``)."""
    dropped: list[DroppedBucket] = field(default_factory=list)
    """Every budget given up: the build's (``BuildRecord.dropped``), then those a capture dropped."""
    strided: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    """(module parameter, its aligned tensor) of each parameter padded past its first dim and still held twice."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pool: tuple[int, int] | None = field(default=None, repr=False)
    """The graphs' shared memory pool, made at the first capture."""

    def __post_init__(self) -> None:
        self.eager, self.kernels, self.folded = self.record.eager, self.record.kernels, self.record.folded
        self.cudagraphs = self.record.cudagraphs
        self.dropped = list(self.record.dropped)

    def warmup(
        self, prepare: Callable[[Bucket], None], agree: Callable[[set[int]], set[int]] | None = None
    ) -> None:
        """Capture every bucket's CUDA graph not captured yet (largest first, one pool), each after
        ``prepare(bucket)`` filled its buffers as for a call with no tokens, then mark the buckets list final;
        idempotent and thread-safe. Once done it costs one attribute read, so every call may ask for it. ``agree``
        (over a group of processes whose graphs hold collectives) maps the budgets captured here to those to keep,
        before ``captured`` is set: no call is served from a bucket before it ran."""
        if self.captured:
            return
        with self._lock:
            if self.captured:
                return
            if self.cudagraphs:
                waiting = [bucket for bucket in self.largest_first() if bucket.graph is None]
                for bucket in tqdm(waiting, desc="vgraph: capturing", unit="graph", leave=False):
                    self._capture(bucket, prepare, "global")
                self.pool_bytes = bucket_graphs.pool_bytes(self._pool) if self._pool is not None else 0
            if agree is not None:
                kept = agree({bucket.shape.budget for bucket in self.buckets})
                self.dropped += [
                    DroppedBucket(bucket.shape.budget, "not captured on every process of the group")
                    for bucket in self.buckets
                    if bucket.shape.budget not in kept
                ]
                self.keep_buckets(kept)
            self.captured = True

    def largest_first(self) -> list[Bucket]:
        """The buckets in capture order."""
        return sorted(self.buckets, key=lambda bucket: -bucket.shape.budget)

    def capture_one(self, bucket: Bucket, prepare: Callable[[Bucket], None]) -> None:
        """Capture ``bucket``'s graph now, while other threads keep working on the device (CUDA's thread-local
        capture mode), unless it is captured, dropped or the buckets are final."""
        with self._lock:
            if not self.captured and bucket.graph is None and any(other is bucket for other in self.buckets):
                self._capture(bucket, prepare, "thread_local")

    def _capture(self, bucket: Bucket, prepare: Callable[[Bucket], None], error_mode: str) -> None:
        """One capture into the encoder's pool (holding ``_lock``); a bucket the device has no memory for is
        dropped."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(False), startup_phases.phase("captures"):
            kept = bucket_graphs.capture(bucket, self.compiled, self._pool, prepare, error_mode)
        if not kept:
            self.dropped.append(DroppedBucket(bucket.shape.budget, "out of GPU memory while capturing its graph"))
            self.buckets = [other for other in self.buckets if other is not bucket]

    def keep_buckets(self, budgets: set[int]) -> None:
        """Keep only the buckets of ``budgets``; every other one's captured graph is reset (its memory and any
        communicator it captured a collective on are released)."""
        for bucket in self.buckets:
            if bucket.shape.budget not in budgets and bucket.graph is not None:
                bucket.graph.reset()
                bucket.graph, bucket.outputs = None, ()
        self.buckets = [bucket for bucket in self.buckets if bucket.shape.budget in budgets]

    def release(self) -> None:
        """Reset every captured graph and drop the buckets: a later call of this encoder runs eagerly. NCCL (2.26+)
        destroys a communicator only once every CUDA graph that captured a collective on it is gone, so the graphs
        of an encoder whose trace holds collectives are released before ``destroy_process_group``."""
        with self._lock:
            self.keep_buckets(set())
            self.captured = True

    def share_strided(self) -> None:
        """Make each parameter of ``strided`` a strided view of its aligned tensor, so its weights are held once
        (the module keeps its shapes and ``state_dict``; eager and autograd calls take the view). Only for callers
        that skip dynamo's guards after the first trace (``vgraph_compile.encoder``): dynamo guards parameters'
        strides, so a guarded call of the module would trace again."""
        for parameter, padded in self.strided:
            _share(parameter, padded)
        self.strided.clear()


def cudagraphs_wanted(ctx: PassContext) -> bool:
    """Whether the encoder captures CUDA graphs; a ``cudagraphs=True`` it cannot honour is a ValueError."""
    config = ctx.config
    wanted = (
        ctx.device.type == "cuda" and config.compiler == "inductor" if config.cudagraphs is None else config.cudagraphs
    )
    if wanted and (ctx.device.type != "cuda" or config.compiler != "inductor"):
        raise ValueError(
            f"cudagraphs=True needs a CUDA encoder compiled with inductor (device {ctx.device}, compiler "
            f"{config.compiler!r}): set cudagraphs=None or compiler='inductor'"
        )
    return wanted


def _share(parameter: torch.Tensor, padded: torch.Tensor) -> None:
    """Make ``parameter``'s data the leading block of ``padded`` (its own storage is freed once unreferenced)."""
    with torch.no_grad():
        parameter.data = padded[tuple(slice(0, size) for size in parameter.shape)]
    _ALIGNED[parameter] = weakref.ref(padded)


def _aligned(parameter: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of ``shape`` holding ``parameter`` in its leading block.

    Padded along its first dim only (a producer's weight rows, its bias), the block is a contiguous view with the
    parameter's own strides: the parameter's data becomes that block, so the weights are held once, and the module
    keeps its shapes, strides (dynamo's guards on it still hold), ``state_dict`` and eager and autograd calls.
    Writes into the parameter (``load_state_dict``, ``copy_``) reach the compiled graphs; the padding stays zero.
    ``module.to(...)``/``.half()`` give the parameter new data the graphs do not see: move and cast the module
    before compiling it. A later trace of the same module (another grad mode, say) gets the same tensor back.

    Padded along a later dim (a consumer's weight columns), the block's row stride is the padded width, and dynamo
    guards the parameter's strides: a view there would make a later guarded call retrace. That weight stays a
    copy until ``CompiledEncoder.share_strided`` (for callers past dynamo's guards) makes it a view too.
    """
    known = _ALIGNED.get(parameter)
    padded = known() if known is not None else None
    if padded is not None and padded.shape == shape and padded.data_ptr() == parameter.data_ptr():
        return padded
    with torch.no_grad(), torch.inference_mode(False):
        padded = parameter.new_zeros(shape)
        block = padded[tuple(slice(0, size) for size in parameter.shape)]
        block.copy_(parameter.detach())
        if block.stride() == parameter.stride():
            _share(parameter, padded)
    return padded


def assemble(spec: VarlenSpec, record: BuildRecord, compiled: CompiledFn, state: list[Any]) -> CompiledEncoder:
    """The encoder of a build: parameters bound (aligned where the layout pads them), kernels prepared, every
    bucket's buffers allocated. ``state`` holds, per graph input, the module's parameter or buffer (None
    elsewhere): the traced values, or the live module's in a process that loaded a build plan."""
    for name, device in record.prepared:
        registry.BACKENDS[name].prepare(torch.device(device))
    layout = record.layout
    bound = [
        _aligned(value, layout.padded[index]) if index in layout.padded else value for index, value in enumerate(state)
    ]
    strided = [
        (state[index], bound[index]) for index in layout.padded if bound[index].data_ptr() != state[index].data_ptr()
    ]
    for index, value in layout.constants.items():
        bound[index] = value
    with torch.inference_mode(False):
        buckets = bucket_graphs.allocate(spec, list(record.shapes), bound, layout.copied, layout.sizes)
    counters.buckets_built += len(buckets)
    roles = {index: spec.inputs[index].role for index in layout.copied}
    return CompiledEncoder(record, compiled, buckets, roles, strided=strided)
