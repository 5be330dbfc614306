"""Start-up of real-size vision towers (random weights, bf16), cold and warm, one process or several at once: where
each second goes, memory, host time per call.

Towers: the Qwen2.5-VL-7B and Qwen3-VL-8B packed towers, and InternViT-300M (InternVL3, 448 px tiles) as the
fixed-tile tower (``--tiny``: each at toy sizes, for the CPU). Per tower and per process count N (``--processes``,
default 1 2), N fresh processes start at once on one new cache directory (inductor's cache, kernel timings and
vgraph's saved artifacts, plans and tower interfaces all live under it), as data-parallel ranks or replicas do:
first on the empty directory (cold), then N more on what they left (warm). Process i runs on GPU i mod ``--gpus``
(default 1: all N on one GPU, 8 processes simulated on one card). Each process times, from the tower built (on its
device) to its first served call:

- ``to_first_call_s``: ``compile_vision_tower`` and the first call (a 1x224^2 image, or one tile) served: a packed
  tower traces (or loads its saved build) on its synthetic image first; the graphs are captured behind that call
  (``VGraphConfig.captures``), and the call runs the compiled code until its bucket is captured;
- ``to_all_captured_s``: to ``capture_all()`` returned after it: every graph captured;
- ``first_replay_s``: the same call once more, served from the captured graphs;
- ``phases_s``: where ``to_all_captured_s`` went, from the library's own record (``vgraph_compile.counters.PHASES``):
  ``interface`` (learned on a shrunk tower, or loaded), ``plan_load``, ``trace`` (dynamo and the rest of the
  build), the pipeline's stages ``analyze``, ``check_call``, ``rewrite`` (with ``kernel_timing`` apart),
  ``compile`` (inductor, or its artifact loaded) and ``assemble``, ``captures``, ``call_costs``, and ``other`` (what no phase holds: the metadata of the warm-up grid, Python around it).

Per N the report gives each process's record and ``max_to_first_call_s`` (the slowest process) with its ratio to one
process alone (``slowdown_vs_one``). With one process (N = 1) each start also reports peak memory (allocated and
reserved), the weights, the graph pool, host time per call (call to return, GPU idle before each) and the median
time of a whole call (``call_ms``) of 1x224^2 and 1x1344^2 (one and eight tiles). ``--options`` passes vgraph
options (JSON). With ``--profile``, each warm single process also profiles its start (``start_profile``: the 40
functions with the most time, nested calls included, from ``compile_vision_tower`` to the first call served; its
times then include the profiler's) and each case's host path (cProfile over 200 calls). With ``--memory``, a
further warm single process records the allocator's history and reports where its peak went (``bench.memory``), so
the timed starts run without the recording.

With ``--interface-only``, each process of a packed tower times only its interface (the ``interface`` phase):
the released-size tower is built on the meta device (the probe runs a shrunk tower of the same class and config
on the host and never reads the tower's weights), cold (learned and saved) and warm (loaded), N processes at once
(``interface_s``, the slowest per N). It needs no GPU.

With ``--host-only``, one process per packed tower on its cache directory (which may exist: a second run serves
from the saved build plan) measures the host time per call alone (1x224^2, 4x336^2, 1x1344^2, 1x1792^2 and a
448x672 image with an 8-frame 336^2 video; 1x224^2 also queued, 200 calls with no synchronize between them:
``host_ms_queued``), plus the host time of a bare ``replay()`` of the bucket that serves each case (``replay_us``),
its device time (``device_ms``), and the host time of the compiled code launched at the call's exact sizes with no
graph (``exact_host_ms``, 1x224^2 and 1x1344^2: what a call leaving its bucket pays; with ``--profile`` where it
goes, ``exact_profile``).

Writes ``benchmarks/results/startup_<device>.json`` (``--json`` to choose), after each tower.

    python benchmarks/startup.py qwen2.5-vl qwen3-vl internvit-448 --cache-dir /tmp/startup --processes 1 2 8
    python benchmarks/startup.py qwen2.5-vl --cache-dir /tmp/startup --processes 2 --gpus 2   # one GPU each
    python benchmarks/startup.py qwen2.5-vl qwen3-vl internvit-448 --cache-dir /tmp/s --tiny --json /tmp/s.json
    python benchmarks/startup.py qwen2-vl --cache-dir /tmp/startup --host-only --json PATH [--profile]
    python benchmarks/startup.py qwen2.5-vl qwen3-vl --cache-dir /tmp/i --interface-only --processes 1 2 --json PATH
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PACKED = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
TINY_OPTIONS = {"packed": {"token_budgets": [256, 1024]}, "tiled": {"max_items": 8}}
"""With ``--tiny``: few small buckets, so the harness runs on the CPU in minutes (``--options`` overrides)."""
TILED = ("internvit-448",)
"""Fixed-tile towers (``bench.tile_towers.build_tile_tower``'s names)."""


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


def _cumulative(profile: cProfile.Profile, rows: int = 40) -> list[str]:
    """The ``rows`` functions with the most time, nested calls included, of a profile taken once (the start)."""
    stats = pstats.Stats(profile).stats
    ordered = sorted(stats.items(), key=lambda item: -item[1][3])[:rows]
    return [
        f"{cumulative:8.3f} s ({own:6.3f} s own), {calls_made:6d} calls: {name} ({os.path.basename(path)}:{line})"
        for (path, line, name), (_, calls_made, own, cumulative, _) in ordered
    ]


def _build(kind: str, tiny: bool, resize: dict, device: str) -> torch.nn.Module:
    """The ``kind`` tower with random weights in bf16 on ``device`` (toy sizes with ``tiny``; ``resize``: config
    fields of a packed tower)."""
    if kind in TILED:
        from vgraph_compile.bench.tile_towers import build_tile_tower

        return build_tile_tower(kind, tiny, torch.bfloat16, device)
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    return qwen_tower(kind, device=device, dtype=torch.bfloat16, **{**(TOY_SIZES[kind] if tiny else {}), **resize})


def _cases(model: torch.nn.Module, kind: str, tiny: bool, device: str) -> dict[str, tuple]:
    """The timed calls' arguments: 1x224^2 and 1x1344^2 images, or one and eight tiles (``tiny``: the first only)."""
    if kind in TILED:
        size = model.config.image_size
        size = size if isinstance(size, int) else size[0]
        cases = {f"{n} tile": (torch.randn(n, 3, size, size, device=device, dtype=torch.bfloat16),) for n in (1, 8)}
    else:
        cases = {case: _case_input(model.config, case, device) for case in ("1x224^2", "1x1344^2")}
    return dict(list(cases.items())[:1]) if tiny else cases


def _wait_for_all(barrier: str | None, rank: int, ranks: int) -> None:
    """Mark this process ready in ``barrier`` (a directory) and wait until all ``ranks`` are: the timed starts of
    the processes begin together, whatever their imports and model builds took."""
    if barrier is None:
        return
    open(os.path.join(barrier, f"ready.{rank}"), "w").close()
    while len([name for name in os.listdir(barrier) if name.startswith("ready.")]) < ranks:
        time.sleep(0.01)


def one_start(
    tower_kind: str,
    tiny: bool,
    resize: dict,
    options: dict,
    alone: bool,
    profile: bool = False,
    memory: bool = False,
    barrier: tuple[str, int, int] | None = None,
) -> dict:
    """One process's start of ``tower_kind``, from the tower on its device to its first served call: total, phases
    and the first replay; ``alone`` (no other process started with it): memory and host time per call too;
    ``memory``: with the allocator's history recorded, and where its peak went."""
    from vgraph_compile.bench.memory import GIB, peak_breakdown
    from vgraph_compile.bench.timing import host_ms_per_call, median_ms, synchronize
    from vgraph_compile.compile.buckets import pool_bytes
    from vgraph_compile.counters import counters, startup_phases
    from vgraph_compile.hf import compile_vision_tower

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _build(tower_kind, tiny, resize, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cases = _cases(model, tower_kind, tiny, device)
    first_case = next(iter(cases.values()))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    if tiny:
        options = {**TINY_OPTIONS["tiled" if tower_kind in TILED else "packed"], **options}
    _wait_for_all(*(barrier or (None, 0, 0)))
    start_profile = cProfile.Profile() if profile else None
    start = time.perf_counter()
    with torch.inference_mode(), start_profile or contextlib.nullcontext():
        if tower_kind in TILED:
            tower = compile_vision_tower(model, **options)
        else:
            tower = compile_vision_tower(model, max_items=8, max_frames=16, **options)
        tower(*first_case)  # traces (a packed tower on its synthetic image first) or loads, then serves
        synchronize(device)
    served = time.perf_counter()
    with torch.inference_mode():
        tower.capture_all()
    synchronize(device)
    captured = time.perf_counter()
    with torch.inference_mode():
        tower(*first_case)
    synchronize(device)
    replayed = time.perf_counter()
    phases = startup_phases.snapshot()
    phases["other"] = captured - start - sum(phases.values())
    report = {
        "to_first_call_s": round(served - start, 3),
        "to_all_captured_s": round(captured - start, 3),
        "first_replay_s": round(replayed - captured, 4),
        "phases_s": {name: round(seconds, 3) for name, seconds in phases.items()},
        "weights_gib": round(weights / GIB, 3),
        "counters": {name: value for name, value in counters.snapshot().items() if value},
    }
    if device == "cuda":
        report |= {
            "device": torch.cuda.get_device_name(),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "pool_gib": round(pool_bytes() / GIB, 3),
        }
    if start_profile is not None:
        report["start_profile"] = _cumulative(start_profile)
    if not alone:
        return report
    host_ms, call_ms, profiles = {}, {}, {}
    with torch.inference_mode():
        for case, arguments in cases.items():
            host_ms_per_call(lambda: tower(*arguments), 10, device)
            host_ms[case] = round(host_ms_per_call(lambda: tower(*arguments), 100, device), 3)
            call_ms[case] = round(median_ms(lambda: tower(*arguments), 20, 3, device), 3)
            if profile:
                profiles[case] = _profile(lambda: tower(*arguments), 200, device)
    report |= {"host_ms": host_ms, "call_ms": call_ms}
    if profiles:
        report["host_profile"] = profiles
    if device == "cuda":
        report["allocated_after_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        if memory:
            report["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
    return report


def interface_start(tower_kind: str, resize: dict, barrier: tuple[str, int, int]) -> dict:
    """One process's interface of the released-size ``tower_kind`` (built on the meta device): learned and saved in
    the run's directory, or loaded from it."""
    from vgraph_compile.counters import counters
    from vgraph_compile.hf.interface.tower_interfaces import tower_interface
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    with torch.device("meta"):
        model = qwen_tower(tower_kind, device="meta", **resize)
    _wait_for_all(*barrier)
    before = counters.snapshot()
    start = time.perf_counter()
    tower_interface(model, Path(barrier[0]).parent / "interfaces")
    seconds = time.perf_counter() - start
    after = counters.snapshot()
    counted = {name: after[name] - before[name] for name in ("probe_forwards", "interfaces_loaded")}
    return {"interface_s": round(seconds, 3), **counted}


HOST_CASES_PX = {
    "1x1792^2": [(1, 1792, 1792)],
    "448x672 + video 8f 336^2": [(1, 448, 672), (8, 336, 336)],
}
"""``--host-only``'s cases beside ``bench.workload.CASES_PX``'s (the host-time goals' largest image, and an image
with a video), as (frames, height px, width px) per item."""


def _case_input(config, case: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from vgraph_compile.bench.workload import CASES_PX, to_grid

    items_px = {**CASES_PX, **HOST_CASES_PX}[case]

    grid_thw = torch.tensor(
        to_grid(items_px, config.patch_size, config.temporal_patch_size, config.spatial_merge_size)
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
        for case in ("1x224^2", "4x336^2", "1x1344^2", "1x1792^2", "448x672 + video 8f 336^2"):
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
        x, grid_thw = _case_input(model.config, "1x224^2", device)
        samples = []
        for _ in range(200):  # queued: no synchronize between calls, the device runs behind the host
            begin = time.perf_counter()
            tower(x, grid_thw)
            samples.append((time.perf_counter() - begin) * 1e3)
        report["host_ms_queued"] = {"1x224^2": round(statistics.median(samples), 3)}
        (runtime,) = tower.runtimes
        runtime.call_choice = "exact_size"  # the compiled code at the call's sizes, launched with no graph
        report["exact_host_ms"], report["exact_profile"] = {}, {}
        for case in ("1x224^2", "1x1344^2"):
            x, grid_thw = _case_input(model.config, case, device)
            host_ms_per_call(lambda: tower(x, grid_thw), 3, device)
            report["exact_host_ms"][case] = round(host_ms_per_call(lambda: tower(x, grid_thw), 20, device), 3)
            if profile:
                report["exact_profile"][case] = _profile(lambda: tower(x, grid_thw), 20, device)
        runtime.call_choice = "smallest_bucket"
    report["counters"] = {name: value for name, value in counters.snapshot().items() if value}
    report["queue"] = os.environ.get("CUDA_SCALE_LAUNCH_QUEUES")
    if device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    return report


def _start_together(args, kind: str, directory: str, processes: int, start: str) -> list[dict]:
    """``processes`` fresh processes of ``kind`` started at once on ``directory``; their reports, in rank order."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
    environment.pop("VGRAPH_ARTIFACT_DIR", None)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(index) for index in range(args.gpus)]
    barrier = os.path.join(directory, f"barrier_{start}")
    os.makedirs(barrier)
    children = []
    for rank in range(processes):
        command = [sys.executable, __file__, kind, "--one", "--cache-dir", directory, "--resize", args.resize]
        command += ["--options", args.options, "--barrier", barrier, str(rank), str(processes)]
        command += ["--tiny"] if args.tiny else []
        command += ["--interface-only"] if args.interface_only else []
        command += ["--profile"] if args.profile and start == "warm" and processes == 1 else []
        command += ["--memory"] if start == "memory" else []
        gpu = {"CUDA_VISIBLE_DEVICES": gpus[rank % len(gpus)]}
        output = [open(os.path.join(barrier, f"{stream}.{rank}"), "w+") for stream in ("stdout", "stderr")]
        child = subprocess.Popen(command, stdout=output[0], stderr=output[1], text=True, env={**environment, **gpu})
        children.append((child, output))
    reports = []
    for rank, (child, (stdout, stderr)) in enumerate(children):
        child.wait()
        stdout.seek(0)
        stderr.seek(0)
        if child.returncode != 0:
            raise SystemExit(f"{kind}: {start} start of process {rank} of {processes} failed:\n{stderr.read()[-4000:]}")
        reports.append(json.loads(stdout.read().strip().splitlines()[-1]))
    return reports


def _summary(reports: list[dict]) -> dict:
    if "interface_s" in reports[0]:
        return {"max_interface_s": max(report["interface_s"] for report in reports), "processes": reports}
    slowest = max(reports, key=lambda report: report["to_first_call_s"])
    return {
        "max_to_first_call_s": slowest["to_first_call_s"],
        "max_to_all_captured_s": max(report["to_all_captured_s"] for report in reports),
        "slowest_phases_s": slowest["phases_s"],
        "processes": reports,
    }


def _device_tag(name: str | None) -> str:
    """``h100``, ``h200``... from a CUDA device name; ``cpu`` without one."""
    if not name:
        return "cpu"
    return next((word.lower() for word in name.split() if word[:1].isalpha() and word[1:].isdigit()), "cuda")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("towers", nargs="+", choices=[*PACKED, *TILED])
    parser.add_argument("--cache-dir", required=True, help="a directory per tower and process count is made under it")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="processes started at once")
    parser.add_argument("--gpus", type=int, default=1, help="process i runs on GPU i mod this")
    parser.add_argument("--tiny", action="store_true", help="toy-size towers (the harness on the CPU)")
    parser.add_argument("--resize", default="{}", help="config fields of a packed tower, as JSON")
    parser.add_argument("--options", default="{}", help="vgraph options as JSON, for compile_vision_tower")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="profile the warm process's host path per call")
    parser.add_argument("--memory", action="store_true", help="a further warm process: where its peak memory went")
    parser.add_argument("--host-only", action="store_true", help="host time per call only, one process per tower")
    parser.add_argument("--interface-only", action="store_true", help="the interface phase only (no GPU needed)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    resize = json.loads(args.resize)
    if args.one:
        if args.host_only:
            print(json.dumps(host_only(args.towers[0], resize, args.profile)))
            return {}
        directory, rank, ranks = args.barrier
        if args.interface_only:
            print(json.dumps(interface_start(args.towers[0], resize, (directory, int(rank), int(ranks)))))
            return {}
        alone = int(ranks) == 1
        report = one_start(args.towers[0], args.tiny, resize, json.loads(args.options), alone, args.profile,
                           args.memory, (directory, int(rank), int(ranks)))  # fmt: skip
        print(json.dumps(report))
        return {}
    report = {"torch": torch.__version__, "options": json.loads(args.options), "tiny": args.tiny, "towers": {}}
    if args.interface_only:
        report |= {"interface_only": True, "host_cores": os.cpu_count()}
    path = args.json
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
            if path:
                with open(path, "w") as file:
                    json.dump(report, file, indent=1)
        return report
    for kind in args.towers:
        rows = report["towers"][kind] = {}
        for processes in args.processes:
            directory = os.path.join(args.cache_dir, kind, f"n{processes}")
            if os.path.exists(directory):
                raise SystemExit(f"{directory} exists: the cold start needs an empty cache directory")
            os.makedirs(directory)
            starts = ("cold", "warm", "memory") if args.memory and processes == 1 else ("cold", "warm")
            row = {start: _summary(_start_together(args, kind, directory, processes, start)) for start in starts}
            alone = rows.get("1")
            for start in ("cold", "warm"):
                if alone is not None:
                    headline = "max_interface_s" if args.interface_only else "max_to_first_call_s"
                    row[start]["slowdown_vs_one"] = round(row[start][headline] / alone[start][headline], 2)
            rows[str(processes)] = row
            print(json.dumps({kind: {processes: {start: {key: value for key, value in row[start].items()
                                                         if key != "processes"} for start in row}}}), flush=True)  # fmt: skip
            device = row["cold"]["processes"][0].get("device")
            report.setdefault("device", device or "cpu")
            path = args.json or os.path.join(os.path.dirname(__file__), "results", f"startup_{_device_tag(device)}.json")
            with open(path, "w") as file:  # after each row, so a run cut short keeps the rows done
                json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
