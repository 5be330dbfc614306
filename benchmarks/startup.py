"""Start-up of real-size Qwen vision towers (random weights, bf16): cold and warm start, memory, host time per call.

Per tower, two fresh processes on one cache directory (inductor's cache, the kernel timings and vgraph's saved
artifacts all live under it): the first on an empty directory (cold), the second on what the first left (warm).
Each times ``compile_vision_tower`` through its first call with every bucket captured, split into phases (the
library functions of each phase timed where they are called):
- analyses: ``analyze`` (sites, roles, bounds);
- kernel_timing: ``choose_kernels`` (``attention_backend="auto"``);
- compile: ``compile_once`` (inductor's compile, or the load of a saved artifact);
- plan_load: ``warm_start.load`` (a saved build plan and its compiled artifact: no trace, no compile);
- capture: ``capture`` (every bucket's CUDA graph);
- trace: the rest (dynamo's trace, rewrites, buffer allocation, learning the tower's interface, its own Python).

Then peak memory (allocated and reserved, after warm-up and the two host cases), the tower's weights, the graph
pool, host time per call (call to return, GPU idle before each) and the median time of a whole call (``call_ms``) of
1x224^2 and 1x1344^2. ``--options`` passes vgraph options (JSON) to ``compile_vision_tower``. With ``--profile``,
the warm process also profiles each case's host path (cProfile over 200 calls, GPU idle before each) and reports
the functions that take the most host time per call. With ``--memory``, a third process starts warm with the
allocator's history recorded and reports where its peak went (``bench.memory``: the live allocations at the peak by
the code that made them, and the graphs' private pools), so the timed starts run without the recording.

With ``--host-only``, one process per tower on its cache directory (which may exist: a second run serves from
the saved build plan) measures the host time per call alone, with no start-up phases, plus the host time of a
bare ``replay()`` of the bucket that serves each case (``replay_us``), and its device time (``device_ms``).

    python benchmarks/startup.py qwen2.5-vl qwen3-vl --cache-dir /tmp/startup --json PATH [--options JSON] [--profile] [--memory]
    python benchmarks/startup.py qwen2-vl --cache-dir /tmp/startup --host-only --json PATH [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import json
import os
import subprocess
import sys
import time

import torch


def _timed(module, name: str, phases: dict[str, float], phase: str) -> None:
    """Replace ``module.name`` by a wrapper that adds its wall time (device synchronized) to ``phases[phase]``."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)


def _profile(fn, calls: int, device: str) -> list[str]:
    """The 12 functions with the most own host time per call of ``fn`` (GPU idle before each call)."""
    profile = cProfile.Profile()
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        profile.enable()
        fn()
        profile.disable()
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    return [
        f"{1e6 * own / calls:8.1f} us own, {calls_made / calls:5.1f} calls: {name} ({os.path.basename(path)}:{line})"
        for (path, line, name), (_, calls_made, own, _, _) in rows
    ]


def one_start(tower_kind: str, resize: dict, options: dict, profile: bool = False, memory: bool = False) -> dict:
    """One process's start of ``tower_kind``: total and phases, memory, host time per call; ``memory``: with the
    allocator's history recorded, and where its peak went."""
    import vgraph_compile.compile.buckets as buckets
    import vgraph_compile.entry.warm_start as warm_start
    import vgraph_compile.pipeline as pipeline
    import vgraph_compile.rewrite.kernel_choice as kernel_choice
    from vgraph_compile.bench.memory import GIB, peak_breakdown
    from vgraph_compile.bench.timing import host_ms_per_call, median_ms
    from vgraph_compile.compile.buckets import pool_bytes
    from vgraph_compile.counters import counters
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    device = "cuda" if torch.cuda.is_available() else "cpu"
    phases: dict[str, float] = {}
    _timed(pipeline, "analyze", phases, "analyses")
    _timed(kernel_choice, "choose_kernels", phases, "kernel_timing")
    _timed(pipeline, "compile_once", phases, "compile")
    _timed(buckets, "capture", phases, "capture")
    _timed(warm_start, "load", phases, "plan_load")
    model = qwen_tower(tower_kind, device=device, dtype=torch.bfloat16, **resize)
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    start = time.perf_counter()
    tower = compile_vision_tower(model, max_items=8, max_frames=16, **options)
    with torch.inference_mode():
        tower.warmup()
    if device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    phases["trace"] = total - sum(phases.values())

    host_ms, call_ms, profiles = {}, {}, {}
    with torch.inference_mode():
        for case in ("1x224^2", "1x1344^2"):
            x, grid_thw = _case_input(config, case, device)
            host_ms_per_call(lambda: tower(x, grid_thw), 10, device)
            host_ms[case] = round(host_ms_per_call(lambda: tower(x, grid_thw), 100, device), 3)
            call_ms[case] = round(median_ms(lambda: tower(x, grid_thw), 20, 3, device), 3)
            if profile:
                profiles[case] = _profile(lambda: tower(x, grid_thw), 200, device)
    report = {
        "start_s": round(total, 2),
        "phases_s": {name: round(seconds, 2) for name, seconds in phases.items()},
        "weights_gib": round(weights / GIB, 3),
        "host_ms": host_ms,
        "call_ms": call_ms,
        "counters": {name: value for name, value in counters.snapshot().items() if value},
    }
    if profiles:
        report["host_profile"] = profiles
    if device == "cuda":
        report |= {
            "device": torch.cuda.get_device_name(),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "pool_gib": round(pool_bytes() / GIB, 3),
            "allocated_after_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        }
        if memory:
            report["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
    return report


def _case_input(config, case: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from vgraph_compile.bench.workload import CASES_PX, to_grid

    grid_thw = torch.tensor(
        to_grid(CASES_PX[case], config.patch_size, config.temporal_patch_size, config.spatial_merge_size)
    )
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    x = torch.randn(int(grid_thw.prod(-1).sum()), width, device=device, dtype=torch.bfloat16)
    return x, grid_thw


def host_only(tower_kind: str, resize: dict, profile: bool = False) -> dict:
    """Host time per call of ``tower_kind`` in this process (traced, or served from a saved plan), and per case
    the bare replay of the bucket that served it."""
    from vgraph_compile.bench.timing import elapsed_ms, host_ms_per_call
    from vgraph_compile.counters import counters
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = qwen_tower(tower_kind, device=device, dtype=torch.bfloat16, **resize)
    tower = compile_vision_tower(model, max_items=8, max_frames=16)
    with torch.inference_mode():
        tower.warmup()
    report = {"host_ms": {}, "replay_us": {}, "device_ms": {}, "host_profile": {}}
    with torch.inference_mode():
        for case in ("1x224^2", "1x1344^2"):
            x, grid_thw = _case_input(model.config, case, device)
            host_ms_per_call(lambda: tower(x, grid_thw), 10, device)
            report["host_ms"][case] = round(host_ms_per_call(lambda: tower(x, grid_thw), 100, device), 3)
            (runtime,) = tower.runtimes
            served = max(runtime.buckets, key=lambda bucket: bucket.stats.hits)
            if served.graph is not None:
                report["replay_us"][case] = round(1e3 * host_ms_per_call(served.graph.replay, 50, device), 1)
            report["device_ms"][case] = round(elapsed_ms(lambda: tower(x, grid_thw), device), 3)
            for bucket in runtime.buckets:
                bucket.stats.hits = 0
            if profile:
                report["host_profile"][case] = _profile(lambda: tower(x, grid_thw), 200, device)
    report["counters"] = {name: value for name, value in counters.snapshot().items() if value}
    report["queue"] = os.environ.get("CUDA_SCALE_LAUNCH_QUEUES")
    if device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("towers", nargs="+", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--cache-dir", required=True, help="a directory per tower is made under it (must be new)")
    parser.add_argument("--resize", default="{}", help="config fields as JSON, for a small dry run")
    parser.add_argument("--options", default="{}", help="vgraph options as JSON, for compile_vision_tower")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="profile the warm process's host path per call")
    parser.add_argument("--memory", action="store_true", help="a third, warm process: where its peak memory went")
    parser.add_argument("--host-only", action="store_true", help="host time per call only, one process per tower")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    resize = json.loads(args.resize)
    if args.one:
        if args.host_only:
            print(json.dumps(host_only(args.towers[0], resize, args.profile)))
        else:
            options = json.loads(args.options)
            print(json.dumps(one_start(args.towers[0], resize, options, args.profile, args.memory)))
        return {}
    report = {"torch": torch.__version__, "options": json.loads(args.options), "towers": {}}
    if args.host_only:
        for kind in args.towers:
            environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(args.cache_dir, kind)}
            environment.pop("VGRAPH_ARTIFACT_DIR", None)
            command = [sys.executable, __file__, kind, "--one", "--host-only", "--cache-dir", args.cache_dir]
            command += ["--resize", args.resize] + (["--profile"] if args.profile else [])
            child = subprocess.run(command, capture_output=True, text=True, env=environment)
            if child.returncode != 0:
                raise SystemExit(f"{kind}: the run failed:\n{child.stderr[-4000:]}")
            report["towers"][kind] = json.loads(child.stdout.strip().splitlines()[-1])
            print(json.dumps({kind: report["towers"][kind]}), flush=True)
            if args.json:
                with open(args.json, "w") as file:
                    json.dump(report, file, indent=1)
        return report
    for kind in args.towers:
        directory = os.path.join(args.cache_dir, kind)
        if os.path.exists(directory):
            raise SystemExit(f"{directory} exists: the cold start needs an empty cache directory")
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
        environment.pop("VGRAPH_ARTIFACT_DIR", None)
        starts = []
        for start in ("cold", "warm", "memory") if args.memory else ("cold", "warm"):
            command = [sys.executable, __file__, kind, "--one", "--cache-dir", directory, "--resize", args.resize]
            command += ["--options", args.options]
            command += {"warm": ["--profile"] if args.profile else [], "memory": ["--memory"]}.get(start, [])
            child = subprocess.run(command, capture_output=True, text=True, env=environment)
            if child.returncode != 0:
                raise SystemExit(f"{kind}: the start failed:\n{child.stderr[-4000:]}")
            starts.append(json.loads(child.stdout.strip().splitlines()[-1]))
        cold, warm = starts[:2]
        report["towers"][kind] = {
            "cold_s": cold["start_s"],
            "warm_s": warm["start_s"],
            "phases": {"cold": cold["phases_s"], "warm": warm["phases_s"]},
            "weights_gib": cold["weights_gib"],
            **{key: cold[key] for key in ("device", "peak_allocated_gib", "peak_reserved_gib", "pool_gib") if key in cold},
            "peak_warm_allocated_gib": warm.get("peak_allocated_gib"),
            "host_ms": warm["host_ms"],
            "allocated_after_gib": cold.get("allocated_after_gib"),
            "call_ms": {"cold": cold["call_ms"], "warm": warm["call_ms"]},
            "counters": {"cold": cold["counters"], "warm": warm["counters"]},
            **({"peak_breakdown": starts[2].get("peak_breakdown")} if args.memory else {}),
            **({"host_profile": warm["host_profile"]} if "host_profile" in warm else {}),
        }
        print(json.dumps({kind: report["towers"][kind]}), flush=True)
        if args.json:  # after each tower, so a run cut short keeps the towers done
            with open(args.json, "w") as file:
                json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
