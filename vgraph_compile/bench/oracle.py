"""The exact-shape oracle: one static compile and one CUDA graph per fixed case, independent of vgraph."""

from __future__ import annotations

import statistics
import time

import torch

from vgraph_compile.bench.result import AfterWarmup, Result
from vgraph_compile.bench.timing import check_deadline, host_ms_per_call, median_ms, synchronize
from vgraph_compile.bench.workload import Workload
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.grid_metadata import Grid, GridMetadata, grid_of
from vgraph_compile.hf.whole_graph.tower_call import TowerCall

__all__ = ["ExactShape", "measure_oracle"]


class ExactShape:
    """The exact-shape oracle for one grid, built without vgraph's runtime: ``torch.compile(dynamic=False)`` of
    the routed tower on static input buffers (pixels and metadata), compiled by a first run; on CUDA then warmed
    up on a side stream and captured in one ``torch.cuda.CUDAGraph``. Per call: check the grid, look up its
    metadata, fill the buffers, replay (on the CPU: run the compiled code on the buffers), copy the outputs out."""

    def __init__(
        self, tower: torch.nn.Module, grid: Grid, metadata: GridMetadata, pixel_values: torch.Tensor, backend: str
    ) -> None:
        self.tower, self.grid, self.metadata = tower, grid, metadata
        self.static = {
            name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in {"pixel_values": pixel_values, **metadata(grid, pixel_values.device)}.items()
        }
        self.compiled = torch.compile(TowerCall(tower, metadata.interface), dynamic=False, backend=backend)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = self._run()
        if pixel_values.is_cuda:
            self.outputs = self._capture()

    def _run(self) -> tuple[torch.Tensor, ...]:
        with routed_attention(self.tower):
            return self.compiled(**self.static)

    def _capture(self) -> tuple[torch.Tensor, ...]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = self._run()
        return outputs

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grid = grid_of(grid_thw)
        if grid != self.grid:
            raise ValueError(f"this exact-shape graph serves grid_thw {list(self.grid)} only, got {list(grid)}")
        self.static["pixel_values"].copy_(pixel_values)
        for name, value in self.metadata(grid, pixel_values.device).items():
            if isinstance(value, torch.Tensor):
                self.static[name].copy_(value)
        if self.graph is None:
            outputs = self._run()
        else:
            self.graph.replay()
            outputs = self.outputs
        return tuple(output.clone() for output in outputs)


def measure_oracle(workload: Workload, result: Result, deadline: float, args) -> None:
    """One ``ExactShape`` per fixed case: its warm-up (compile and capture), median time and host time."""
    metadata = GridMetadata(workload.tower, workload.interface)
    warmups = []
    for case, grid in workload.cases.items():
        x, grid_thw = workload.inputs(grid)
        start = time.perf_counter()
        exact = ExactShape(workload.tower, tuple(grid), metadata, x, args.compile_backend)
        exact(x, grid_thw)
        synchronize(workload.device)
        warmups.append(time.perf_counter() - start)
        if not args.warmup_only:
            after_warmup = AfterWarmup()
            result.cases_ms[case] = median_ms(lambda: exact(x, grid_thw), args.repeats, 0, workload.device)
            if case == workload.host_case:
                result.host_ms_per_call_p50 = host_ms_per_call(
                    lambda: exact(x, grid_thw), args.host_calls, workload.device
                )
            after_warmup.stop(result)
        exact = None  # free its graph and buffers before the next case compiles
        check_deadline(deadline, f"case {case}")
    result.warmup_s = statistics.mean(warmups)
    result.extra["warmup_is"] = "mean per case (one exact-shape compile and capture each)"
