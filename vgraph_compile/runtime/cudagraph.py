"""Compile a static bucket graph, and capture it as a CUDA graph through inductor's CUDA graph trees.

Lifecycle of one bucket with CUDA graphs on (``capture``): the first run warms up (eager kernels, allocator
state), the second records into the process-wide pool that every bucket shares, later runs replay. Each run
starts a new tree generation (``cudagraph_mark_step_begin``), so every bucket is a root of the tree and any
bucket may follow any other without a re-record. Outputs live in the pool until the next run: the runtime
copies out what it returns.

What this module does not own: the persistent input buffers (they are ``get_attr`` tensors of the static
graph, registered by ``passes/specialize``, filled by ``runtime/runner``).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
import torch.fx
from torch._guards import tracing

from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters

__all__ = ["compile_static", "run_static", "capture", "recorded_graphs"]

log = logging.getLogger(__name__)

StaticFn = Callable[[], Sequence]


def compile_static(static: torch.fx.GraphModule, config: VGraphConfig, cudagraphs: bool) -> StaticFn:
    """The callable that runs ``static`` (a graph with no inputs) as configured."""
    counters.buckets_compiled += 1
    if config.compiler == "eager":
        return static.forward
    from torch._inductor.compile_fx import compile_fx

    with tracing(None), torch.no_grad():
        compiled = compile_fx(static, [], config_patches={"triton.cudagraphs": cudagraphs})
    return compiled


def run_static(fn: StaticFn, cudagraphs: bool) -> Sequence:
    """One run of a compiled bucket; with CUDA graphs, a new generation (replay as a root)."""
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.no_grad():
        return fn()


def capture(fns: Sequence[StaticFn]) -> None:
    """Warm up every bucket, then record each, in the given order (largest bucket first)."""
    for fn in fns:
        run_static(fn, cudagraphs=True)
    for fn in fns:
        before = recorded_graphs()
        run_static(fn, cudagraphs=True)
        counters.graphs_captured += recorded_graphs() - before


def recorded_graphs(device_index: int | None = None) -> int:
    """CUDA graphs recorded so far in the CUDA graph tree of ``device_index`` (default: current device)."""
    from torch._inductor import cudagraph_trees

    if device_index is None:
        device_index = torch.cuda.current_device()
    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if manager is None:
        return 0
    total = 0
    stack = [node for nodes in manager.roots.values() for node in nodes]
    while stack:
        node = stack.pop()
        if isinstance(node, cudagraph_trees.CUDAGraphNode):
            total += 1
        stack.extend(child for children in node.children.values() for child in children)
    return total
