"""The systems: how each is built from the tower (the stock tower, torch.compile variants, vgraph)."""

from __future__ import annotations

from typing import Callable

import torch

from vgraph_compile.bench.workload import Workload
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.grid_metadata import GridMetadata, grid_of
from vgraph_compile.hf.whole_graph.tower_call import TowerCall
from vgraph_compile.hf.vlm import compile_vision_tower

__all__ = ["SYSTEMS", "NEEDS_CUDA", "routed_compile", "factories"]

SYSTEMS = (
    "hf_eager_sdpa",
    "eager_varlen",
    "torch_compile_routed",
    "torch_compile_dynamic",
    "torch_compile_reduce_overhead",
    "exact_shape_oracle",
    "vgraph",
    "vgraph_conservative",
)
NEEDS_CUDA = {"torch_compile_reduce_overhead": "it records inductor's CUDA graph trees"}
"""Systems that have no CPU form, and why."""


def routed_compile(tower: torch.nn.Module, metadata: GridMetadata, backend: str = "inductor") -> Callable:
    """``torch.compile(dynamic=True)`` of the tower with vgraph's attention routing and host-side metadata:
    ``(pixel_values, grid_thw) -> (pooler_output, last_hidden_state, *deepstack)``."""
    compiled = torch.compile(TowerCall(tower, metadata.interface), dynamic=True, backend=backend)

    def call(pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        with routed_attention(tower):
            return compiled(pixel_values, **metadata(grid_of(grid_thw), pixel_values.device))

    return call


def factories(workload: Workload, args) -> dict[str, Callable[[], Callable]]:
    """System name -> a function that builds it (``exact_shape_oracle`` is built per case by ``oracle``)."""
    tower, device = workload.tower, workload.device

    def stock(fn):
        return lambda x, grid_thw: fn(x, grid_thw.to(device))

    def routed(x, grid_thw):
        with routed_attention(tower):
            return tower(x, grid_thw.to(device))

    return {
        "hf_eager_sdpa": lambda: stock(tower),
        "eager_varlen": lambda: routed,
        "torch_compile_routed": lambda: routed_compile(
            tower, GridMetadata(tower, workload.interface), args.compile_backend
        ),
        "torch_compile_dynamic": lambda: stock(torch.compile(tower, dynamic=True, backend=args.compile_backend)),
        "torch_compile_reduce_overhead": lambda: stock(torch.compile(tower, mode="reduce-overhead")),
        "vgraph": lambda: compile_vision_tower(tower, **args.vgraph_option),
        "vgraph_conservative": lambda: compile_vision_tower(
            tower, **{**args.vgraph_option, "window_bound": "conservative"}
        ),
    }
