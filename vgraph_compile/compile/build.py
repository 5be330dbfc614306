"""The build stage (``graphs``): one compiled graph for a traced encoder, then per bucket its buffers and captured graph.

``build(gm, ctx)`` runs after the analyses (``ctx.spec``, ``ctx.buckets``): it rewrites two copies of the trace
(the eager fallback, and the graph inductor compiles once), binds the parameters (padded where ``align_matmuls``
asked), prepares the kernels' state, and allocates every bucket's buffers. ``CompiledEncoder.warmup()`` captures
the CUDA graphs (on the first call). The runtime only validates, fills, replays and narrows.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from vgraph_compile.kernels import registry
from vgraph_compile.compile import buckets as bucket_graphs
from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.compile.inductor import CompiledFn, compile_once
from vgraph_compile.compile.kernel_timing import choose_kernels
from vgraph_compile.counters import counters
from vgraph_compile.rewrite import COMPILE_REWRITES, REWRITES, fold_scalars, rewrite, select_kernel
from vgraph_compile.rewrite.align_matmuls import PADDED_SHAPE
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import PassContext, Role

__all__ = ["build", "CompiledEncoder"]

log = logging.getLogger(__name__)

_ALIGNED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
"""Module parameter -> a weak reference to the aligned tensor that owns its storage (``_aligned``)."""


@dataclass
class CompiledEncoder:
    """What the build made of one trace; the runtime serves calls from it."""

    eager: torch.fx.GraphModule
    """The trace with the configured kernels, run as is for calls no bucket serves."""
    compiled: CompiledFn
    """The graph compiled once, symbolic in every token and segment size."""
    buckets: list[Bucket]
    """Smallest budget first."""
    cudagraphs: bool
    roles: dict[int, Role]
    """Role of each input filled per call, by graph input index."""
    kernels: dict[int, str] = field(default_factory=dict)
    """Attention group -> the kernel its sites run."""
    folded: dict[int, float | int | bool] = field(default_factory=dict)
    """Graph input index -> the scalar value the graphs were built with (``rewrite/fold_scalars``)."""
    pool_bytes: int = 0
    """Device memory the capture reserved (the graphs' shared pool and the warm-up runs)."""
    captured: bool = False
    """Whether ``warmup`` ran (the buckets list is final)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def warmup(self) -> None:
        """Capture every bucket's CUDA graph (largest first, one pool); idempotent and thread-safe. Once done it
        costs one attribute read, so every call may ask for it."""
        if self.captured:
            return
        with self._lock:
            if self.captured:
                return
            if self.cudagraphs:
                reserved = torch.cuda.memory_reserved()
                with torch.inference_mode(False):
                    self.buckets = bucket_graphs.capture(self.buckets, self.compiled, self.roles)
                self.pool_bytes = torch.cuda.memory_reserved() - reserved
            self.captured = True


def _cudagraphs(ctx: PassContext) -> bool:
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


def _aligned(parameter: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of ``shape`` holding ``parameter`` in its leading block.

    Padded along its first dim only (a producer's weight rows, its bias), the block is a contiguous view with the
    parameter's own strides: the parameter's data becomes that block, so the weights are held once, and the module
    keeps its shapes, strides (dynamo's guards on it still hold), ``state_dict`` and eager and autograd calls.
    Writes into the parameter (``load_state_dict``, ``copy_``) reach the compiled graphs; the padding stays zero.
    ``module.to(...)``/``.half()`` give the parameter new data the graphs do not see: move and cast the module
    before compiling it. A later trace of the same module (another grad mode, say) gets the same tensor back.

    Padded along a later dim (a consumer's weight columns), the block's row stride is the padded width, and dynamo
    guards the parameter's strides: a view there would make every later guarded call retrace. That weight stays a
    zero-padded copy.
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
            parameter.data = block
            _ALIGNED[parameter] = weakref.ref(padded)
    return padded


def _bind_parameters(gm: torch.fx.GraphModule, ctx: PassContext) -> list[Any]:
    """Per graph input: the parameter tensor (at its aligned shape where ``align_matmuls`` asked) or None (filled
    per call)."""
    bound: list[Any] = []
    for node, role in zip(gm.graph.find_nodes(op="placeholder"), ctx.spec.inputs):
        value = ctx.example_inputs[role.index]
        if role.role is not Role.PARAMETER:
            bound.append(None)
            continue
        padded = node.meta.get(PADDED_SHAPE)
        if padded is not None:
            value = _aligned(value, tuple(padded))
        bound.append(value)
    return bound


def build(gm: torch.fx.GraphModule, ctx: PassContext) -> CompiledEncoder:
    """Rewrite, compile once, bind and allocate; ``gm`` itself is left as traced."""
    cudagraphs = _cudagraphs(ctx)
    folded = fold_scalars.folded(gm, ctx)
    ctx.kernels = choose_kernels(gm, ctx)
    eager = rewrite(copy.deepcopy(gm), ctx, REWRITES)
    compiled_graph = rewrite(copy.deepcopy(gm), ctx, REWRITES + COMPILE_REWRITES)
    for name, device in select_kernel.kernels_used(compiled_graph):
        registry.BACKENDS[name].prepare(device)
    bound = _bind_parameters(compiled_graph, ctx)
    compiled, shapes = compile_once(compiled_graph, ctx)
    placeholders = list(compiled_graph.graph.find_nodes(op="placeholder"))
    copied, sizes = {}, {}
    for role, node in zip(ctx.spec.inputs, placeholders):
        value = example_value(node)
        if isinstance(value, torch.Tensor) and bound[role.index] is None:
            copied[role.index] = (value.dtype, value.device)
        elif isinstance(value, torch.SymInt):
            sizes[role.index] = value.node.expr
        elif not isinstance(value, torch.Tensor):
            bound[role.index] = value
    with torch.inference_mode(False):
        buckets = bucket_graphs.allocate(ctx.spec, shapes, bound, copied, sizes)
    counters.buckets_built += len(buckets)
    roles = {index: ctx.spec.inputs[index].role for index in copied}
    kernels = select_kernel.kernels_by_group(compiled_graph, ctx)
    return CompiledEncoder(eager, compiled, buckets, cudagraphs, roles, kernels, folded)
