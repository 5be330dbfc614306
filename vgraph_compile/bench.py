"""``vgraph-bench``: a Qwen vision tower under every runtime a user would consider, same work, one process.

Systems:
- ``hf_eager_sdpa``: the stock tower; ``eager_varlen``: the stock tower with vgraph's attention op, no graphs;
- ``torch_compile_routed``: ``torch.compile(dynamic=True)`` (inductor, default mode) of the tower with vgraph's
  attention routing and the same host-side grid metadata the vgraph tower uses: the best plain torch.compile;
- ``torch_compile_dynamic`` and ``torch_compile_reduce_overhead``: torch.compile of the stock tower, reported as
  they end (both fail or time out on the real towers);
- ``exact_shape_oracle``: independent of vgraph's runtime. Per fixed case, ``torch.compile(dynamic=False)`` of
  the routed tower for exactly that shape, captured in one ``torch.cuda.CUDAGraph``, with the same per-call host
  work (metadata lookup, fill, replay, copy out);
- ``vgraph``: ``compile_vision_tower`` with the library's defaults; ``vgraph_conservative``: window segments
  sized by the token budget.

Per system: warm-up (build and first call), trace latencies, fixed cases, host time per call
(``host_ms_per_call_p50``: call to return with the GPU idle before it), dynamo recompiles and CUDA graph
re-records after warm-up, peak memory, and for vgraph its own counters. Each system gets a wall-clock limit;
one that does not finish is reported with how far it got.

    vgraph-bench [--tower qwen2.5-vl] [--systems vgraph hf_eager_sdpa ...] [--json PATH] [--plot PATH]
    vgraph-bench --second-start --cache-dir DIR ...  # then the same run, warm-up only, in a fresh process
    vgraph-bench --merge a.json b.json --json all.json --targets --baseline-peak-gib 1.89  # no GPU needed
    vgraph-bench --device cpu --resize depth=1 ...    # the harness on the CPU (timings not comparable)
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vgraph_compile.counters import counters
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.packed_tower import learn_packed_tower
from vgraph_compile.hf.vision_tower import Grid, _TowerCall, compile_vision_tower
from vgraph_compile.serve.runtime import padded_fraction

__all__ = [
    "main",
    "trace",
    "median_ms",
    "CASES_PX",
    "ExactShape",
    "HostMetadata",
    "cuda_graph_captures",
    "targets",
    "targets_table",
]

CASES_PX = {
    "1x224^2": [(1, 224, 224)],
    "4x336^2": [(1, 336, 336)] * 4,
    "3 mixed": [(1, 224, 224), (1, 448, 672), (1, 672, 448)],
    "1x1344^2": [(1, 1344, 1344)],
    "video 16f 336^2": [(16, 336, 336)],
}
"""Fixed cases as (frames, height px, width px) per item."""
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


def to_grid(items_px, patch: int, temporal: int, merge: int) -> list[tuple[int, int, int]]:
    """(t, h, w) in patches, as the processor resizes: sides rounded to multiples of patch x merge."""
    unit = patch * merge

    def patches(pixels: int) -> int:
        return max(1, round(pixels / unit)) * merge

    return [(max(1, frames // temporal), patches(h), patches(w)) for frames, h, w in items_px]


def trace(seed: int = 0, requests: int = 64) -> list[list[tuple[int, int, int]]]:
    """Requests of 1-4 images (sides 224-1344 px, aspect 1:2 to 2:1); one in six also carries a 336^2 video."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        items = []
        for _ in range(rng.randint(1, 4)):
            long_side = rng.randint(224, 1344)
            short_side = max(224, int(long_side / rng.uniform(1.0, 2.0)))
            h, w = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
            items.append((1, h, w))
        if rng.random() < 1 / 6:
            items.append((rng.choice([4, 8, 16]), 336, 336))
        out.append(items)
    return out


@dataclass
class Result:
    latencies_ms: list[float] = field(default_factory=list)
    cases_ms: dict[str, float] = field(default_factory=dict)
    warmup_s: float = 0.0
    host_ms_per_call_p50: float | None = None
    """Median host time from call to return, the device idle before each call."""
    recompiles: int = 0
    """Dynamo graphs compiled after warm-up."""
    rerecords: int = 0
    """CUDA graphs recorded after warm-up."""
    peak_mem_gib: float = 0.0
    status: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        stats = {}
        if lat:
            stats = {
                "p50_ms": round(statistics.median(lat), 2),
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
                "mean_ms": round(statistics.mean(lat), 2),
            }
        if self.host_ms_per_call_p50 is not None:
            stats["host_ms_per_call_p50"] = round(self.host_ms_per_call_p50, 3)
        return {
            **stats,
            "requests": len(lat),
            "warmup_s": round(self.warmup_s, 1),
            "recompiles": self.recompiles,
            "rerecords": self.rerecords,
            "peak_mem_gib": round(self.peak_mem_gib, 2),
            "status": self.status,
            **self.extra,
        }


# -- clocks and counts ---------------------------------------------------------------------------------------------
def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn: Callable[[], Any], device: torch.device | str = "cuda") -> float:
    """Device time of one ``fn()``: CUDA events on CUDA, wall time around a synchronized call on the CPU."""
    if torch.device(device).type != "cuda":
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, device: torch.device | str = "cuda") -> float:
    """Median of ``repeats`` timings of ``fn`` (``elapsed_ms``), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeats))


def host_ms_per_call(fn: Callable[[], Any], calls: int = 50, device: torch.device | str = "cuda") -> float:
    """Median host wall time from call to return, the device idle before each call (synchronized, untimed)."""
    samples = []
    for _ in range(calls):
        synchronize(device)
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
    synchronize(device)
    return statistics.median(samples)


_captures = 0


@functools.cache
def _count_captures() -> None:
    original = torch.cuda.CUDAGraph.capture_begin

    @functools.wraps(original)
    def capture_begin(self, *args, **kwargs):
        global _captures
        _captures += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture_begin


def cuda_graph_captures() -> int:
    """CUDA graphs recorded in this process since the first call, whoever recorded them (inductor's graph trees,
    vgraph's build, the oracle): each goes through ``torch.cuda.CUDAGraph.capture_begin``, counted here."""
    _count_captures()
    return _captures


def _dynamo_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def matmul_peak_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10), the MFU denominator."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b, repeats=10) / 1e9


def tower_flops(tower, grid) -> float:
    """Matmul and attention FLOPs of one forward (the merger and patch embedding included)."""
    config = tower.config
    width = getattr(config, "embed_dim", None) or config.hidden_size  # Qwen2-VL's hidden_size is the merger's
    mlp = getattr(config, "intermediate_size", None) or width * getattr(config, "mlp_ratio", 4)
    gated = type(tower).__name__.startswith("Qwen2_5")
    tokens = sum(t * h * w for t, h, w in grid)
    frames = [h * w for t, h, w in grid for _ in range(t)]
    window = (config.window_size // config.patch_size) ** 2 if gated else None
    full_blocks = set(getattr(config, "fullatt_block_indexes", range(config.depth)))
    flops = 2 * tokens * width * (4 * width + (3 if gated else 2) * mlp) * config.depth
    for block in range(config.depth):
        segment = sum(f * f for f in frames) if (block in full_blocks or not gated) else tokens * window
        flops += 4 * segment * width
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    merged = tokens // config.spatial_merge_size**2
    out = getattr(config, "out_hidden_size", None) or config.hidden_size
    merge_width = width * config.spatial_merge_size**2
    return flops + 2 * tokens * patch_dim * width + 2 * merged * merge_width * (merge_width + out)


# -- systems --------------------------------------------------------------------------------------------------------
def grid_of(grid_thw: torch.Tensor) -> Grid:
    return tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())


class HostMetadata:
    """``grid -> the tower's grid metadata keywords on device``, computed on the host once per distinct grid and
    kept, as the vgraph tower does: a system given these does the same host-side metadata work per call."""

    def __init__(self, tower: torch.nn.Module, device: torch.device | str) -> None:
        self.tower, self.interface, self.device = tower, learn_packed_tower(tower), torch.device(device)
        self.cache: dict[Grid, dict[str, Any]] = {}

    def __call__(self, grid: Grid) -> dict[str, Any]:
        if grid not in self.cache:
            with routed_attention(self.tower):
                host = self.interface.metadata.compute(torch.tensor(grid, dtype=torch.int64))
            self.cache[grid] = {
                name: value.to(self.device) if isinstance(value, torch.Tensor) else value
                for name, value in host.items()
            }
        return self.cache[grid]


def routed_compile(tower: torch.nn.Module, metadata: HostMetadata, backend: str = "inductor") -> Callable:
    """``torch.compile(dynamic=True)`` of the tower with vgraph's attention routing and host-side metadata:
    ``(pixel_values, grid_thw) -> (pooler_output, last_hidden_state, *deepstack)``."""
    compiled = torch.compile(_TowerCall(tower, metadata.interface), dynamic=True, backend=backend)

    def call(pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        with routed_attention(tower):
            return compiled(pixel_values, **metadata(grid_of(grid_thw)))

    return call


class ExactShape:
    """The exact-shape oracle for one grid, built without vgraph's runtime: ``torch.compile(dynamic=False)`` of
    the routed tower on static input buffers (pixels and metadata), compiled by a first run; on CUDA then warmed
    up on a side stream and captured in one ``torch.cuda.CUDAGraph``. Per call: check the grid, look up its
    metadata, fill the buffers, replay (on the CPU: run the compiled code on the buffers), copy the outputs out."""

    def __init__(
        self, tower: torch.nn.Module, grid: Grid, metadata: HostMetadata, pixel_values: torch.Tensor, backend: str
    ) -> None:
        self.tower, self.grid, self.metadata = tower, grid, metadata
        self.static = {
            name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in {"pixel_values": pixel_values, **metadata(grid)}.items()
        }
        self.compiled = torch.compile(_TowerCall(tower, metadata.interface), dynamic=False, backend=backend)
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
        for name, value in self.metadata(grid).items():
            if isinstance(value, torch.Tensor):
                self.static[name].copy_(value)
        if self.graph is None:
            outputs = self._run()
        else:
            self.graph.replay()
            outputs = self.outputs
        return tuple(output.clone() for output in outputs)


@dataclass
class Workload:
    """The tower, the trace's requests and the fixed cases as grids (patches), and how inputs are made."""

    tower: torch.nn.Module
    requests: list[list[tuple[int, int, int]]]
    cases: dict[str, list[tuple[int, int, int]]]
    device: torch.device
    dtype: torch.dtype

    @property
    def host_case(self) -> str:
        """The smallest fixed case: where host time per call is measured."""
        return min(self.cases, key=lambda case: sum(t * h * w for t, h, w in self.cases[case]))

    def inputs(self, grid) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.tower.config
        width = config.in_channels * config.temporal_patch_size * config.patch_size**2
        grid_thw = torch.tensor(grid)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), width, device=self.device, dtype=self.dtype)
        return pixels, grid_thw


def _factories(workload: Workload, args) -> dict[str, Callable[[], Callable]]:
    tower, device = workload.tower, workload.device

    def stock(fn):
        return lambda x, grid_thw: fn(x, grid_thw.to(device))

    def routed(x, grid_thw):
        with routed_attention(tower):
            return tower(x, grid_thw.to(device))

    return {
        "hf_eager_sdpa": lambda: stock(tower),
        "eager_varlen": lambda: routed,
        "torch_compile_routed": lambda: routed_compile(tower, HostMetadata(tower, device), args.compile_backend),
        "torch_compile_dynamic": lambda: stock(torch.compile(tower, dynamic=True, backend=args.compile_backend)),
        "torch_compile_reduce_overhead": lambda: stock(torch.compile(tower, mode="reduce-overhead")),
        "vgraph": lambda: compile_vision_tower(tower, **args.vgraph_option),
        "vgraph_conservative": lambda: compile_vision_tower(
            tower, **{**args.vgraph_option, "window_bound": "conservative"}
        ),
    }


def run(args) -> dict[str, Any]:
    """Every system of ``args.systems`` on the same workload, one after the other: the report."""
    from vgraph_compile.models.qwen_towers import qwen_tower

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = qwen_tower(args.tower, device=args.device, dtype=dtype, **args.resize)
    config = tower.config
    grid = functools.partial(
        to_grid, patch=config.patch_size, temporal=config.temporal_patch_size, merge=config.spatial_merge_size
    )
    workload = Workload(
        tower,
        [grid(items) for items in trace(args.seed, args.requests)],
        {name: grid(CASES_PX[name]) for name in args.cases},
        device,
        dtype,
    )
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": f"{args.tower} vision tower (real config sizes, random weights, {str(dtype).removeprefix('torch.')})"
        + (f", resized {args.resize}" if args.resize else ""),
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "cases": {name: CASES_PX[name] for name in args.cases},
            "host_case": workload.host_case,
            "vgraph_options": args.vgraph_option,
            "compile_backend": args.compile_backend,
            "warmup_only": args.warmup_only,
        },
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "systems": {},
        "cases": {},
    }
    peak = None
    if device.type == "cuda" and not args.warmup_only:
        peak = matmul_peak_tflops()
        report["bf16_matmul_peak_tflops"] = round(peak, 1)
    factories = _factories(workload, args)
    for name in args.systems:
        result = _run_system(name, factories.get(name), workload, args, peak)
        report["systems"][name] = result.summary()
        for case, ms in result.cases_ms.items():
            report["cases"].setdefault(case, {})[name] = round(ms, 2)
        print(f"{name}: {report['systems'][name]}", flush=True)
    return report


def _run_system(name: str, factory, workload: Workload, args, peak: float | None) -> Result:
    result = Result()
    if workload.device.type != "cuda" and name in NEEDS_CUDA:
        result.status = f"needs CUDA: {NEEDS_CUDA[name]}"
        return result
    torch._dynamo.reset()
    if workload.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    deadline = time.perf_counter() + args.time_limit
    before = counters.snapshot()
    with torch.inference_mode():
        try:
            if name == "exact_shape_oracle":
                _measure_oracle(workload, result, deadline, args)
            else:
                _measure(factory, workload, result, deadline, args, peak)
        except TimeoutError as stop:
            result.status = f"did not finish in {args.time_limit} s: {stop}"
        except Exception as error:  # a system that breaks is reported, never dropped
            result.status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if name.startswith("vgraph"):
        after = counters.snapshot()
        result.extra["vgraph_counters"] = {key: value - before.get(key, 0) for key, value in after.items()}
    if workload.device.type == "cuda":
        result.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    return result


def _check_deadline(deadline: float, what: str) -> None:
    if time.perf_counter() > deadline:
        raise TimeoutError(what)


class _AfterWarmup:
    """Dynamo recompiles and CUDA graph recordings from construction to ``stop(result)``."""

    def __init__(self) -> None:
        self.graphs, self.captures = _dynamo_graphs(), cuda_graph_captures()

    def stop(self, result: Result) -> None:
        result.recompiles += _dynamo_graphs() - self.graphs
        result.rerecords += cuda_graph_captures() - self.captures


def _measure(factory, workload: Workload, result: Result, deadline: float, args, peak: float | None) -> None:
    device, requests = workload.device, workload.requests
    start = time.perf_counter()
    fn = factory()
    if hasattr(fn, "warmup"):
        fn.warmup()
    fn(*workload.inputs(requests[0]))
    synchronize(device)
    result.warmup_s = time.perf_counter() - start
    if args.warmup_only:
        return
    for index, grid in enumerate(requests[:4]):  # first sight of typical shapes, outside the timed part
        fn(*workload.inputs(grid))
        _check_deadline(deadline, f"warm-up, request {index}")
    fn(*workload.inputs(workload.cases[workload.host_case]))
    after_warmup = _AfterWarmup()
    try:  # a system that runs out of time still reports the recompiles it made
        for index, grid in enumerate(requests):
            x, grid_thw = workload.inputs(grid)
            result.latencies_ms.append(elapsed_ms(lambda: fn(x, grid_thw), device))
            _check_deadline(deadline, f"{index + 1} of {len(requests)} requests timed")
        x, grid_thw = workload.inputs(workload.cases[workload.host_case])
        result.host_ms_per_call_p50 = host_ms_per_call(lambda: fn(x, grid_thw), args.host_calls, device)
        for case, grid in workload.cases.items():
            x, grid_thw = workload.inputs(grid)
            result.cases_ms[case] = median_ms(lambda: fn(x, grid_thw), args.repeats, warmup=1, device=device)
            _check_deadline(deadline, f"case {case}")
    finally:
        after_warmup.stop(result)
    if hasattr(fn, "runtimes"):
        stats = [bucket.stats for runtime in fn.runtimes for bucket in runtime.buckets]
        result.extra["padded_fraction"] = round(padded_fraction(stats), 3)
        result.extra["buckets"] = fn.stats_table()
        if peak is not None and "1x1344^2" in result.cases_ms:
            flops = tower_flops(workload.tower, workload.cases["1x1344^2"])
            result.extra["mfu_1x1344"] = round(flops / result.cases_ms["1x1344^2"] / 1e9 / peak, 3)


def _measure_oracle(workload: Workload, result: Result, deadline: float, args) -> None:
    metadata = HostMetadata(workload.tower, workload.device)
    warmups = []
    for case, grid in workload.cases.items():
        x, grid_thw = workload.inputs(grid)
        start = time.perf_counter()
        exact = ExactShape(workload.tower, tuple(grid), metadata, x, args.compile_backend)
        exact(x, grid_thw)
        synchronize(workload.device)
        warmups.append(time.perf_counter() - start)
        if not args.warmup_only:
            after_warmup = _AfterWarmup()
            result.cases_ms[case] = median_ms(lambda: exact(x, grid_thw), args.repeats, 0, workload.device)
            if case == workload.host_case:
                result.host_ms_per_call_p50 = host_ms_per_call(
                    lambda: exact(x, grid_thw), args.host_calls, workload.device
                )
            after_warmup.stop(result)
        exact = None  # free its graph and buffers before the next case compiles
        _check_deadline(deadline, f"case {case}")
    result.warmup_s = statistics.mean(warmups)
    result.extra["warmup_is"] = "mean per case (one exact-shape compile and capture each)"


def merge(paths: list[str]) -> dict[str, Any]:
    """One report from several runs of the same workload (systems and cases side by side)."""
    reports = [json.load(open(path)) for path in paths]
    merged = {key: value for key, value in reports[0].items() if key not in ("systems", "cases")}
    merged["systems"], merged["cases"] = {}, {}
    for report in reports:
        merged["systems"].update(report["systems"])
        for case, row in report["cases"].items():
            merged["cases"].setdefault(case, {}).update(row)
    return merged


def table(report: dict[str, Any]) -> str:
    lines = [f"{report['device']}, torch {report['torch']}, {report['model']}"]
    lines.append(
        f"{'system':>30} {'p50':>8} {'p99':>8} {'mean':>8} {'host ms':>8} {'warmup s':>9} {'recomp':>7} "
        f"{'rerec':>6} {'mem GiB':>8}  status"
    )
    for name, row in report["systems"].items():
        cells = ("p50_ms", "p99_ms", "mean_ms", "host_ms_per_call_p50")
        lines.append(
            f"{name:>30} "
            + " ".join(f"{row.get(cell, '-'):>8}" for cell in cells)
            + f" {row.get('warmup_s', '-'):>9} {row.get('recompiles', '-'):>7} {row.get('rerecords', '-'):>6} "
            f"{row.get('peak_mem_gib', '-'):>8}  {row.get('status', '-')}"
        )
    systems = list(report["systems"])
    lines.append("\n" + f"{'case ms':>16} " + " ".join(f"{name[:14]:>14}" for name in systems))
    for case, row in report["cases"].items():
        lines.append(f"{case:>16} " + " ".join(f"{row.get(name, '-'):>14}" for name in systems))
    return "\n".join(lines)


# -- targets --------------------------------------------------------------------------------------------------------
def _ended_ok(report: dict[str, Any], system: str) -> bool:
    """Whether ``system`` ran to the end: a failed run's numbers (its zeros above all) prove nothing."""
    return report["systems"].get(system, {}).get("status") == "ok"


def _value(report: dict[str, Any], system: str, key: str) -> float | None:
    return report["systems"][system].get(key) if _ended_ok(report, system) else None


def _case(report: dict[str, Any], case: str, system: str) -> float | None:
    return report["cases"].get(case, {}).get(system) if _ended_ok(report, system) else None


def _of_vgraph(key: str) -> Callable[[dict[str, Any], float | None], float | None]:
    return lambda report, baseline: _value(report, "vgraph", key)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def _worst_case_vs_oracle(report: dict[str, Any], baseline: float | None) -> float | None:
    ratios = [
        _ratio(_case(report, case, "vgraph"), _case(report, case, "exact_shape_oracle")) for case in report["cases"]
    ]
    return max((ratio for ratio in ratios if ratio is not None), default=None)


@dataclass(frozen=True)
class Target:
    measure: str
    compare: Callable[[float, float], bool]
    """``operator.le`` (at most ``bound``) or ``operator.ge`` (at least)."""
    bound: float
    value: Callable[[dict[str, Any], float | None], float | None]
    """The measured value from a (merged) report and the baseline peak GiB; None when the report lacks it."""


ORACLE_TARGET = Target("worst fixed case, vgraph / exact_shape_oracle", operator.le, 1.05, _worst_case_vs_oracle)
TARGETS = (
    Target(
        "trace p50, hf_eager_sdpa / vgraph",
        operator.ge,
        7.0,
        lambda report, baseline: _ratio(_value(report, "hf_eager_sdpa", "p50_ms"), _value(report, "vgraph", "p50_ms")),
    ),
    Target(
        "trace p50, torch_compile_routed / vgraph",
        operator.ge,
        1.5,
        lambda report, baseline: _ratio(
            _value(report, "torch_compile_routed", "p50_ms"), _value(report, "vgraph", "p50_ms")
        ),
    ),
    ORACLE_TARGET,
    Target(
        "1x224^2 ms, vgraph",
        operator.le,
        3.0,
        lambda report, baseline: _case(report, "1x224^2", "vgraph"),
    ),
    Target("host ms per call, vgraph", operator.le, 0.15, _of_vgraph("host_ms_per_call_p50")),
    Target("cold warm-up s, vgraph", operator.le, 30.0, _of_vgraph("warmup_s")),
    Target("second-process warm-up s, vgraph", operator.le, 10.0, _of_vgraph("second_start_warmup_s")),
    Target("recompiles after warm-up, vgraph", operator.le, 0, _of_vgraph("recompiles")),
    Target("re-records after warm-up, vgraph", operator.le, 0, _of_vgraph("rerecords")),
    Target(
        "peak memory, vgraph / baseline",
        operator.le,
        1.2,
        lambda report, baseline: _ratio(_value(report, "vgraph", "peak_mem_gib"), baseline),
    ),
)
"""The issue's targets, each read from one merged report."""


def targets(report: dict[str, Any], baseline_peak_gib: float | None = None) -> list[dict[str, Any]]:
    """Each target's measured value (rounded to 3 decimals) and verdict; ``pass`` is None where the report does
    not hold the measure (a system not run, or run without finishing its timed part)."""
    rows = []
    for target in TARGETS:
        value = target.value(report, baseline_peak_gib)
        sign = "<=" if target.compare is operator.le else ">="
        rows.append(
            {
                "measure": target.measure,
                "target": f"{sign} {target.bound:g}",
                "measured": None if value is None else round(value, 3),
                "pass": None if value is None else bool(target.compare(value, target.bound)),
            }
        )
    return rows


def targets_table(rows: list[dict[str, Any]]) -> str:
    verdicts = {True: "pass", False: "FAIL", None: "not measured"}
    lines = [f"{'target':>46} {'bound':>8} {'measured':>9}  verdict"]
    for row in rows:
        measured = "-" if row["measured"] is None else f"{row['measured']:g}"
        lines.append(f"{row['measure']:>46} {row['target']:>8} {measured:>9}  {verdicts[row['pass']]}")
    return "\n".join(lines)


# -- second start ---------------------------------------------------------------------------------------------------
def _workload_argv(args) -> list[str]:
    """The command-line options that define the run (tower, systems, workload, compile settings)."""
    argv = ["--tower", args.tower, "--systems", *args.systems, "--cases", *args.cases, "--device", args.device]
    argv += ["--requests", str(args.requests), "--seed", str(args.seed), "--time-limit", str(args.time_limit)]
    argv += ["--compile-backend", args.compile_backend]
    for flag, pairs in (("--resize", args.resize), ("--vgraph-option", args.vgraph_option)):
        if pairs:
            argv += [flag, *(f"{key}={json.dumps(value)}" for key, value in pairs.items())]
    return argv


def second_start(args) -> dict[str, Any]:
    """The same systems' warm-up again in a fresh process with the same inductor cache directory: its report."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "second_start.json")
        command = [sys.executable, "-m", "vgraph_compile.bench", *_workload_argv(args), "--warmup-only"]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": args.cache_dir}
        subprocess.run([*command, "--json", out], env=env, check=True)
        with open(out) as handle:
            return json.load(handle)


def _add_second_start(report: dict[str, Any], second: dict[str, Any]) -> None:
    report["second_start_inductor_cache_dir"] = second["inductor_cache_dir"]
    for name, row in second["systems"].items():
        report["systems"][name]["second_start_warmup_s"] = row["warmup_s"]
        if row["status"] != "ok":
            report["systems"][name]["second_start_status"] = row["status"]


def write_report(report: dict[str, Any], path: str | None) -> None:
    """Write ``report`` as JSON to ``path`` (nothing when no path was asked for); every benchmark script's output."""
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError as missing:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(report["cases"])
    systems = [name for name in report["systems"] if any(name in report["cases"][c] for c in cases)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    bar = 0.8 / max(1, len(systems))
    for index, name in enumerate(systems):
        values = [report["cases"][case].get(name, float("nan")) for case in cases]
        left.bar([c + index * bar for c in range(len(cases))], values, bar, label=name)
    left.set_xticks([c + 0.4 - bar / 2 for c in range(len(cases))], cases, rotation=15)
    left.set_ylabel("median ms per call")
    left.set_yscale("log")
    left.legend(fontsize=7)
    left.set_title(f"{report['model']}\n{report['device']}", fontsize=9)
    ratios = [
        report["cases"][c].get("vgraph", float("nan")) / report["cases"][c].get("exact_shape_oracle", float("nan"))
        for c in cases
    ]
    right.bar(cases, ratios)
    right.axhline(ORACLE_TARGET.bound, color="red", linestyle="--", label=f"{ORACLE_TARGET.bound}x target")
    right.set_ylabel("vgraph / exact-shape oracle")
    right.tick_params(axis="x", rotation=15)
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _key_value(pair: str) -> tuple[str, Any]:
    key, sep, text = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. depth=1, token_budgets=[1024,4096]), got {pair!r}")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vgraph-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tower", default="qwen2.5-vl", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--cases", nargs="+", default=list(CASES_PX), choices=list(CASES_PX))
    parser.add_argument("--requests", type=int, default=64, help="requests in the seeded trace (at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per fixed case (median)")
    parser.add_argument("--host-calls", type=int, default=50, help="calls of the smallest case for host time")
    parser.add_argument("--time-limit", type=float, default=240.0, help="wall seconds per system")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--resize", nargs="+", type=_key_value, default=[], metavar="KEY=VALUE", help="tower config overrides"
    )
    parser.add_argument(
        "--vgraph-option",
        nargs="+",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="compile_vision_tower options for the vgraph systems (default: the library's defaults)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="backend of torch_compile_routed, torch_compile_dynamic and exact_shape_oracle",
    )
    parser.add_argument("--warmup-only", action="store_true", help="measure each system's warm-up only")
    parser.add_argument(
        "--second-start",
        action="store_true",
        help="then run the same systems' warm-up in a fresh process with the same inductor cache directory",
    )
    parser.add_argument(
        "--cache-dir", help="TORCHINDUCTOR_CACHE_DIR for this run (with --second-start: default a fresh one)"
    )
    parser.add_argument("--targets", action="store_true", help="print the targets table and store it in the JSON")
    parser.add_argument("--baseline-peak-gib", type=float, help="peak memory the vgraph target compares against")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--merge", nargs="+", help="combine these JSON reports instead of running")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    args.resize, args.vgraph_option = dict(args.resize), dict(args.vgraph_option)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.merge:
        report = merge(args.merge)
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(
                "vgraph-bench times CUDA graphs and no CUDA GPU is visible: run it on a machine with one "
                "(--device cpu runs the harness on the CPU, e.g. with --resize depth=1; timings not comparable)"
            )
        if args.second_start and args.cache_dir is None:
            args.cache_dir = tempfile.mkdtemp(prefix="vgraph-bench-inductor-")
        if args.cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(args.cache_dir)
            args.cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        report = run(args)
        if args.second_start:
            _add_second_start(report, second_start(args))
    print(table(report))
    if args.targets:
        report["targets"] = targets(report, args.baseline_peak_gib)
        print(targets_table(report["targets"]))
    write_report(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
