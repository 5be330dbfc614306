"""The harness: every system on the same workload, one after the other, each under a wall-clock limit."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch

from vgraph_compile.bench.flops import matmul_peak_tflops, tower_flops
from vgraph_compile.bench.oracle import measure_oracle
from vgraph_compile.bench.result import AfterWarmup, Result
from vgraph_compile.bench.systems import NEEDS_CUDA, factories
from vgraph_compile.bench.timing import check_deadline, elapsed_ms, host_ms_per_call, median_ms, synchronize
from vgraph_compile.bench.workload import CASES_PX, Workload, random_requests, to_grid
from vgraph_compile.counters import counters
from vgraph_compile.compile.buckets import padded_fraction

__all__ = ["run"]


def run(args) -> dict[str, Any]:
    """Every system of ``args.systems`` on the same workload, one after the other: the report."""
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = qwen_tower(args.tower, device=args.device, dtype=dtype, **args.resize)
    config = tower.config
    grid = functools.partial(
        to_grid, patch=config.patch_size, temporal=config.temporal_patch_size, merge=config.spatial_merge_size
    )
    workload = Workload(
        tower,
        [grid(items) for items in random_requests(args.seed, args.requests)],
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
    builders = factories(workload, args)
    for name in args.systems:
        result = _run_system(name, builders.get(name), workload, args, peak)
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
                measure_oracle(workload, result, deadline, args)
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
        check_deadline(deadline, f"warm-up, request {index}")
    fn(*workload.inputs(workload.cases[workload.host_case]))
    after_warmup = AfterWarmup()
    try:  # a system that runs out of time still reports the recompiles it made
        for index, grid in enumerate(requests):
            x, grid_thw = workload.inputs(grid)
            result.latencies_ms.append(elapsed_ms(lambda: fn(x, grid_thw), device))
            check_deadline(deadline, f"{index + 1} of {len(requests)} requests timed")
        x, grid_thw = workload.inputs(workload.cases[workload.host_case])
        result.host_ms_per_call_p50 = host_ms_per_call(lambda: fn(x, grid_thw), args.host_calls, device)
        for case, grid in workload.cases.items():
            x, grid_thw = workload.inputs(grid)
            result.cases_ms[case] = median_ms(lambda: fn(x, grid_thw), args.repeats, warmup=1, device=device)
            check_deadline(deadline, f"case {case}")
    finally:
        after_warmup.stop(result)
    if hasattr(fn, "runtimes"):
        stats = [bucket.stats for runtime in fn.runtimes for bucket in runtime.buckets]
        result.extra["padded_fraction"] = round(padded_fraction(stats), 3)
        result.extra["buckets"] = fn.stats_table()
        if peak is not None and "1x1344^2" in result.cases_ms:
            flops = tower_flops(workload.tower, workload.cases["1x1344^2"], workload.interface)
            result.extra["mfu_1x1344"] = round(flops / result.cases_ms["1x1344^2"] / 1e9 / peak, 3)
