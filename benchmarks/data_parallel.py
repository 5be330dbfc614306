"""Data- and sequence-parallel vision encoding: Qwen vision towers on 1 GPU vs N GPUs (``process_group``), NCCL.

Every rank holds the whole tower (released size, random weights, bf16; nothing is downloaded) and is called with
the same requests; with N > 1 ranks each encodes its share and all-gathers the rest. Workload: ``vgraph-bench``'s
seeded random requests (1-4 images of 224-1344 px, one request in six with a video), run back to back for throughput, then
requests of exactly 4 images (the same generator, filtered) timed one by one for p50/p99 latency (a
request's latency is the slowest rank's, from a common start). Each group is a fresh set of processes
(``torch.multiprocessing.spawn``); ``NCCL_NVLS_ENABLE=0`` (no NVLink multicast) is set for every one of them.

``--parallel`` picks the mode of the N-rank groups for that trace (``data``, ``sequence`` or ``auto``: per call).
Before the trace, the first ``--error-requests`` requests are encoded in each of ``--error-modes`` (default: the
trace's mode) and compared with the same rank alone: per mode each call was served in (``data``, ``sequence``,
``sequence+data``), the relative error (``hf/parallel/parallel_error.relative_error``: the norm of the difference over the
norm of the one-rank output, every field of a call together; max and median over calls), one rank's own error
against the stock tower in float64 on the same request, and the bound, ``ERROR_BOUND_FACTOR`` times that own error
(``hf/parallel/parallel_error``), checked per call (``error_vs_one_rank``). ``--towers`` picks the towers of the trace (one
group per tower and group size; the report's ``groups`` per tower) and of ``--sequence``.
With ``--sequence``, also one large item on 1 vs N GPUs, sequence parallel: the latency of 1x1344^2, 1x1792^2 and a
16-frame 448^2 video for each tower (released sizes), each group compiled with buckets of
exactly those sizes (a rank's slice on N ranks), and the 1x1792^2 output's error against the stock tower (eager).
With ``--parallel auto`` the large items are served by ``auto`` instead (a video may go by frames, data parallel),
each case recording its calls per mode. With ``--profile`` too, each case's time per rank by kernel kind
(all-to-all, attention, gemm...), its host time, the all-to-all captured in the graphs against one run outside
them, and the heads padded (``sequence_profile``).
Every group closes its tower (``CompiledVisionTower.close``) before ``destroy_process_group`` and prints how long
that took.

With ``--vlm-requests N``, also the whole Qwen2.5-VL-7B (language model replicated on every rank, vision tower
data-parallel): time to first token of ``ttft.py``'s first N requests, per group size.

    python benchmarks/data_parallel.py --ranks 1 2 --vlm-requests 32 --json benchmarks/results/data_parallel_h200x2.json
    python benchmarks/data_parallel.py --device cpu --tiny --vlm-requests 4 --json /tmp/dp.json   # gloo, toy sizes
    python benchmarks/data_parallel.py --ranks 1 2 --parallel auto --sequence --profile --json /tmp/sequence.json
    python benchmarks/data_parallel.py --ranks 1 2 --parallel auto --error-modes data sequence auto --json /tmp/err.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import statistics
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.result import Result
from vgraph_compile.bench.timing import synchronize
from vgraph_compile.bench.workload import random_requests, to_grid
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.hf.interface.packed_tower import config_geometry
from vgraph_compile.hf.parallel.parallel_error import ERROR_BOUND_FACTOR, Float64Reference, output_fields, relative_error
from vgraph_compile.hf.parallel.sequence_parallel import split_rows

TINY_OPTIONS = dict(token_budgets=[256, 1280], max_items=4, compiler="eager", attention_backend="sdpa")
SEQUENCE_ITEMS = {"1x1344^2": [(1, 1344, 1344)], "1x1792^2": [(1, 1792, 1792)], "video 16x448^2": [(16, 448, 448)]}
"""--sequence: one item each, (frames, height, width) in pixels."""
TOWERS = ("qwen2.5-vl", "qwen3-vl")
TINY_SCALE = 4
"""--tiny divides the requests' pixel sizes by this (56-336 px), so the CPU's dense attention masks stay small."""


def workload(args, config) -> tuple[list[list[tuple[int, int, int]]], list[list[tuple[int, int, int]]]]:
    """(random requests, 4-image requests) as grids of (t, h, w) patches of the tower ``config``; the same on
    every rank."""
    scale = TINY_SCALE if args.tiny else 1

    def grid(items):
        scaled = [(t, h // scale, w // scale) for t, h, w in items]
        return to_grid(scaled, config.patch_size, config.temporal_patch_size, config.spatial_merge_size)

    requests = [grid(items) for items in random_requests(args.seed, args.requests)]
    four = [grid(items) for items in random_requests(args.seed + 1, 16 * args.latency_requests) if len(items) == 4]
    return requests, four[: args.latency_requests]


def _inputs(grid, width: int, device: torch.device, dtype: torch.dtype, seed: int):
    generator = torch.Generator(device).manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grid)
    pixels = torch.randn(patches, width, generator=generator, device=device, dtype=dtype)
    return pixels, torch.tensor(grid, dtype=torch.int64)


def _join(rank: int, ranks: int, directory: str, args) -> tuple[torch.device, torch.dtype]:
    """Join the group (NCCL on GPU ``rank``, or gloo); the device and dtype this rank runs."""
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{directory}/init",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(minutes=10),
    )
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if cuda else torch.float32
    return torch.device(f"cuda:{rank}" if cuda else "cpu"), dtype


def _write(directory: str, report: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "report.json"), "w") as handle:
            json.dump(report, handle)


def _timed(device: torch.device, call) -> float:
    """Milliseconds of ``call()``, from a barrier every rank passes to this rank's device being done."""
    dist.barrier()
    synchronize(device)
    begin = time.perf_counter()
    call()
    synchronize(device)
    return (time.perf_counter() - begin) * 1e3


def _slowest(latencies: list[float]) -> list[float]:
    """Per request, the slowest rank's latency (every rank started it after a common barrier)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, latencies)
    return [max(column) for column in zip(*every)]


def _tower_rank(rank: int, ranks: int, directory: str, args) -> None:
    """One rank of one group: warm up, run the requests back to back, time the 4-image requests; rank 0 writes."""
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    device, dtype = _join(rank, ranks, directory, args)
    cuda = device.type == "cuda"
    compiled = None
    try:
        start = time.perf_counter()
        name = args.trace_tower
        tower = qwen_tower(name, device=device, dtype=dtype, **(TOY_SIZES[name] if args.tiny else {}))
        options = TINY_OPTIONS if args.tiny else {}
        group = dist.group.WORLD if ranks > 1 else None
        compiled = compile_vision_tower(tower, process_group=group, parallel=args.parallel, **options)
        requests, four = workload(args, tower.config)
        (width,) = compiled.interface.pixel_shape
        with torch.inference_mode():
            compiled.warmup()
            for index, grid in enumerate(requests[:4] + four[:2]):  # first sight of typical shapes
                compiled(*_inputs(grid, width, device, dtype, index))
            synchronize(device)
            warmup_s = time.perf_counter() - start
            report = {"warmup_s": round(warmup_s, 1)}
            if ranks > 1:
                grids = requests[: args.error_requests]
                report["error_vs_one_rank"] = errors_vs_one_rank(compiled, grids, args.error_modes, width, dtype)
            inputs = [_inputs(grid, width, device, dtype, index) for index, grid in enumerate(requests)]
            dist.barrier()
            synchronize(device)
            begin = time.perf_counter()
            for pixel_values, grid_thw in inputs:
                compiled(pixel_values, grid_thw)
            synchronize(device)
            seconds = time.perf_counter() - begin
            del inputs
            latencies = []
            for index, grid in enumerate(four):
                pixel_values, grid_thw = _inputs(grid, width, device, dtype, 1000 + index)
                latencies.append(_timed(device, lambda: compiled(pixel_values, grid_thw)))
        patches = sum(t * h * w for grid in requests for t, h, w in grid)
        summary = Result(latencies_ms=_slowest(latencies)).summary()
        report.update(
            requests=len(requests),
            patches=patches,
            seconds=round(seconds, 3),
            requests_per_s=round(len(requests) / seconds, 2),
            patches_per_s=round(patches / seconds),
            latency_4_images={key: summary[key] for key in ("p50_ms", "p99_ms", "mean_ms", "requests")},
            peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            parallel_calls=dict(compiled.parallel_calls),
            stats=compiled.stats_table(),
        )
        _write(directory, report)
    finally:
        _teardown(None if args.no_close else compiled)


def _sequence_rank(rank: int, ranks: int, directory: str, args) -> None:
    """One rank of one group: per tower, compile with buckets of exactly the items' sizes (this group's slice),
    then per item 3 warm calls and ``--sequence-repeats`` timed ones (the slowest rank's, from a common start);
    rank 0 writes."""
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    device, dtype = _join(rank, ranks, directory, args)
    try:
        report = {}
        for name in args.towers:
            tower = qwen_tower(name, device=device, dtype=dtype, **(TOY_SIZES[name] if args.tiny else {}))
            config = tower.config
            geometry = config_geometry(config, getattr(config, "window_size", None) if name == "qwen2.5-vl" else None)
            scale = TINY_SCALE * 4 if args.tiny else 1
            grids = {
                case: to_grid(
                    [(t, h // scale, w // scale) for t, h, w in items],
                    config.patch_size,
                    config.temporal_patch_size,
                    config.spatial_merge_size,
                )
                for case, items in SEQUENCE_ITEMS.items()
            }
            unit = config.spatial_merge_size**2
            sizes = {case: split_rows(tuple(grid), geometry, ranks, unit).slice_rows for case, grid in grids.items()}
            start = time.perf_counter()
            options = dict(token_budgets=sorted(set(sizes.values())), max_frames=16)
            if args.tiny:
                options.update(compiler="eager", attention_backend="sdpa")
            group = dist.group.WORLD if ranks > 1 else None
            mode = "auto" if args.parallel == "auto" else "sequence"
            compiled = compile_vision_tower(tower, process_group=group, parallel=mode, **options)
            (width,) = compiled.interface.pixel_shape
            cases = {}
            with torch.inference_mode():
                for index, (case, grid) in enumerate(grids.items()):
                    pixel_values, grid_thw = _inputs(grid, width, device, dtype, index)
                    for _ in range(3):
                        out = compiled(pixel_values, grid_thw)
                    latencies = []
                    for _ in range(args.sequence_repeats):
                        latencies.append(_timed(device, lambda: compiled(pixel_values, grid_thw)))
                    summary = Result(latencies_ms=_slowest(latencies)).summary()
                    cases[case] = {"grid": grid, "slice_rows": sizes[case], "p50_ms": summary["p50_ms"],
                                   "mean_ms": summary["mean_ms"], "parallel_calls": dict(compiled.parallel_calls)}
                    compiled.parallel_calls.clear()
                    if case == "1x1792^2":
                        stock = compiled.tower(pixel_values, grid_thw.to(device)).pooler_output.float()
                        error = (out.pooler_output.float() - stock).norm() / stock.norm()
                        cases[case]["pooler_rel_err_vs_stock_eager"] = round(float(error), 5)
                    if args.profile and device.type == "cuda":
                        cases[case]["profile"] = sequence_profile(compiled, pixel_values, grid_thw, sizes[case])
            report[name] = {"warmup_s": round(time.perf_counter() - start, 1), "cases": cases,
                            "stats": compiled.stats_table()}
            print(f"rank {rank}/{ranks} {name}: {cases}", flush=True)
            if not args.no_close:
                compiled.close()
            del compiled, tower
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _write(directory, report)
    finally:
        _teardown(None)


def _teardown(compiled) -> None:
    """Release the tower's sequence-parallel graphs (their captured all-to-alls hold the NCCL communicator:
    ``CompiledVisionTower.close``), then destroy the group, and say how long that took."""
    if compiled is not None:
        compiled.close()
    begin = time.perf_counter()
    dist.destroy_process_group()
    print(f"destroy_process_group: {time.perf_counter() - begin:.2f} s", flush=True)


def sequence_profile(compiled, pixel_values, grid_thw, slice_rows: int, calls: int = 5) -> dict:
    """Where one sequence-parallel call's time goes, on every rank (rank 0 returns all of them):

    - ``ranks``: per rank, device ms per call by kernel kind (all-to-all, attention, gemm...: ``kernel_breakdown``
      of the graphs' replays, collectives captured inside them) and host ms per call (the call's Python and
      launches, no sync): a rank whose device time is the longest holds the others at the next all-to-all;
    - ``all_to_all_outside_graphs_ms``: one eager ``all_to_all_single`` of a layer's q (``[rows, heads, head_dim]``
      with heads padded to a multiple of the ranks), against ``all_to_all_in_graphs_ms``, the captured ones' mean;
    - ``heads`` and ``padded_heads``: the share of attention (and all-to-all bytes) spent on padding heads.
    """
    from vgraph_compile.bench.kernel_profile import kernel_breakdown

    device = pixel_values.device
    ranks = dist.get_world_size()
    breakdown = kernel_breakdown(lambda: compiled(pixel_values, grid_thw), calls=calls)
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(calls):
        compiled(pixel_values, grid_thw)
    host_ms = (time.perf_counter() - begin) * 1e3 / calls
    synchronize(device)
    attention = next(m for m in compiled.tower.modules() if hasattr(m, "num_heads") and hasattr(m, "head_dim"))
    heads, head_dim = attention.num_heads, attention.head_dim
    padded = -(-heads // ranks) * ranks
    chunk = torch.randn(slice_rows * padded * head_dim, device=device, dtype=pixel_values.dtype)
    received = torch.empty_like(chunk)
    dist.all_to_all_single(received, chunk)
    dist.barrier()
    synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dist.all_to_all_single(received, chunk)
    end.record()
    end.synchronize()
    in_graphs = breakdown["by_kind_ms"].get("all-to-all (nccl)", 0.0) / max(
        breakdown["by_kind_calls"].get("all-to-all (nccl)", 0), 1
    )
    mine = {
        "device_ms_per_call": breakdown["device_ms_total"],
        "by_kind_ms": breakdown["by_kind_ms"],
        "host_ms_per_call": round(host_ms, 3),
        "all_to_all_in_graphs_ms": round(in_graphs, 4),
        "all_to_all_outside_graphs_ms": round(start.elapsed_time(end) / 20, 4),
        "top": breakdown["top"][:8],
    }
    every = [None] * ranks
    dist.all_gather_object(every, mine)
    return {
        "heads": heads,
        "padded_heads": padded,
        "padding_share": round((padded - heads) / padded, 3),
        "slice_rows": slice_rows,
        "ranks": every,
    }


def _vlm_rank(rank: int, ranks: int, directory: str, args) -> None:
    """One rank of one group serving the whole Qwen2.5-VL-7B, its language model replicated: ``ttft.py``'s
    request list through the real image processor, each request's time to first token after a common barrier
    (the slowest rank's), after one warm-up pass; rank 0 writes."""
    import ttft

    from vgraph_compile.hf import compile_vlm
    from vgraph_compile.sample_models.qwen_vlms import image_processor, model_inputs, qwen_vlm

    device, dtype = _join(rank, ranks, directory, args)
    try:
        start = time.perf_counter()
        setting = ttft.SETTINGS["tiny" if args.tiny else "real"]
        model = qwen_vlm("qwen2.5-vl", tiny=args.tiny, device=device, dtype=dtype, seed=args.seed)
        processor = image_processor(model.config, max_patches=setting["max_patches"])
        requests = ttft.random_requests(args.seed, args.vlm_requests, setting["sides"], setting["video"])
        batches = [model_inputs(model, [request], processor, device) for request in requests]
        compile_vlm(model, process_group=dist.group.WORLD if ranks > 1 else None, **setting["options"])
        with torch.inference_mode():
            for inputs in batches:
                ttft.timed_generate(model, inputs, 1, device)
            warmup_s = time.perf_counter() - start
            latencies, tokens = [], []
            for inputs in batches:
                dist.barrier()
                out, ms = ttft.timed_generate(model, inputs, 1, device)
                latencies.append(ms)
                tokens.append(out[:, -1].tolist())
        summary = Result(latencies_ms=_slowest(latencies)).summary()
        _write(
            directory,
            {
                "requests": len(batches),
                "warmup_s": round(warmup_s, 1),
                "ttft_p50_ms": summary["p50_ms"],
                "ttft_p99_ms": summary["p99_ms"],
                "ttft_mean_ms": summary["mean_ms"],
                "first_tokens": tokens,
            },
        )
    finally:
        dist.destroy_process_group()


def _one_rank(compiled, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """``compiled`` on this rank alone (``process_group=None``): the same single-process graphs, no collective."""
    group, compiled.process_group = compiled.process_group, None
    try:
        return compiled(pixel_values, grid_thw)
    finally:
        compiled.process_group = group


def errors_vs_one_rank(compiled, grids, modes: list[str], width: int, dtype: torch.dtype) -> dict[str, Any]:
    """Per mode a call was served in: its calls, the relative error of each against this rank alone (max, median),
    this rank's own error against the float64 stock tower (max, median), the largest ratio of a call's error to its
    bound (``ERROR_BOUND_FACTOR`` x its own error: <= 1 within the bound) and the largest absolute difference. Each
    of ``grids`` is encoded in every one of ``modes`` (``parallel=``); the calls are not counted in
    ``parallel_calls``."""
    device = compiled.parameter.device
    reference = Float64Reference(compiled.tower)
    counted, trace_mode = collections.Counter(compiled.parallel_calls), compiled.parallel
    served: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for index, grid in enumerate(grids):
        pixel_values, grid_thw = _inputs(grid, width, device, dtype, index)
        alone = output_fields(_one_rank(compiled, pixel_values, grid_thw))
        own = relative_error(alone, reference(pixel_values, grid_thw.to(device)))
        for mode in modes:
            compiled.parallel = mode
            before = collections.Counter(compiled.parallel_calls)
            spread = output_fields(compiled(pixel_values, grid_thw))
            (call_mode,) = compiled.parallel_calls - before
            largest = max(float((a.float() - b.float()).abs().max()) for a, b in zip(spread, alone))
            served[call_mode].append((relative_error(spread, alone), own, largest))
    compiled.parallel_calls, compiled.parallel = counted, trace_mode
    del reference
    report: dict[str, Any] = {"requests": len(grids), "modes_asked": modes, "bound_factor": ERROR_BOUND_FACTOR}
    for call_mode, rows in sorted(served.items()):
        errors, owns, largest = zip(*rows)
        ratio = max(error / (ERROR_BOUND_FACTOR * own) if own else float(error > 0) for error, own, _ in rows)
        report[call_mode] = {
            "calls": len(rows),
            "relative_error_max": float(f"{max(errors):.3g}"),
            "relative_error_median": float(f"{statistics.median(errors):.3g}"),
            "one_rank_error_vs_float64_max": float(f"{max(owns):.3g}"),
            "one_rank_error_vs_float64_median": float(f"{statistics.median(owns):.3g}"),
            "max_ratio_to_bound": round(ratio, 4),
            "within_bound": ratio <= 1.0,
            "max_abs_diff": max(largest),
        }
    return report


def run_group(target, ranks: int, args) -> dict[str, Any]:
    """One fresh group of ``ranks`` processes running ``target``: rank 0's report."""
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(target, args=(ranks, directory, args), nprocs=ranks)
        with open(os.path.join(directory, "report.json")) as handle:
            return json.load(handle)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="group sizes to run, one after another")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL; cpu: gloo")
    parser.add_argument("--tiny", action="store_true", help="the toy tower, smaller images (for the CPU)")
    parser.add_argument("--requests", type=int, default=64, help="random requests run back to back")
    parser.add_argument("--latency-requests", type=int, default=64, help="4-image requests timed one by one")
    parser.add_argument("--vlm-requests", type=int, default=0, help="also the whole VLM's TTFT, on this many requests")
    parser.add_argument("--parallel", choices=["data", "sequence", "auto"], default="data", help="mode of the trace")
    parser.add_argument("--sequence", action="store_true", help="also one large item per call, sequence parallel")
    parser.add_argument("--sequence-repeats", type=int, default=20, help="timed calls per item with --sequence")
    parser.add_argument("--skip-trace", action="store_true", help="skip the trace and 4-image groups")
    parser.add_argument(
        "--towers", nargs="+", choices=TOWERS, default=list(TOWERS), help="towers of the trace and of --sequence"
    )
    parser.add_argument("--profile", action="store_true", help="with --sequence: where each case's time goes")
    parser.add_argument(
        "--no-close",
        action="store_true",
        help="diagnosis: destroy each group with its tower's sequence graphs alive (their captured all-to-alls "
        "hold the NCCL communicator: destroy_process_group waits on NCCL >= 2.26, pytorch#115388)",
    )
    parser.add_argument(
        "--error-modes",
        nargs="+",
        choices=["data", "sequence", "auto"],
        help="modes whose error against one rank is measured on --error-requests requests (default: --parallel)",
    )
    parser.add_argument("--error-requests", type=int, default=16, help="requests the error is measured on")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    args.error_modes = args.error_modes or [args.parallel]
    if args.device == "cuda" and torch.cuda.device_count() < max(args.ranks):
        parser.error(f"--ranks {max(args.ranks)} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by every process spawned below
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": f"{', '.join(args.towers)} vision tower(s), "
        + ("toy size" if args.tiny else "released size, random weights")
        + f", {args.dtype or ('bfloat16' if args.device == 'cuda' else 'float32')}",
        "workload": {"trace_requests": args.requests, "latency_requests": args.latency_requests, "seed": args.seed},
        "env": {"NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"]},
        "groups": {},
    }
    report["workload"]["parallel"] = args.parallel
    if args.sequence:
        report["sequence"] = {
            "mode": "auto" if args.parallel == "auto" else "sequence",
            "groups": {str(ranks): run_group(_sequence_rank, ranks, args) for ranks in args.ranks},
        }
        groups = report["sequence"]["groups"]
        if "1" in groups and len(groups) > 1:
            ratios = {
                ranks: {
                    name: {case: round(row["p50_ms"] / groups["1"][name]["cases"][case]["p50_ms"], 3)
                           for case, row in tower["cases"].items()}
                    for name, tower in group.items()
                }
                for ranks, group in groups.items() if ranks != "1"
            }
            report["sequence"]["latency_vs_1_rank"] = ratios
            most = str(max(args.ranks))
            report["sequence"]["one_image_latency_ratio"] = max(row["1x1792^2"] for row in ratios[most].values())
            print(f"sequence latency vs 1 rank: {ratios} (target <= 0.6 at 1x1792^2 on 2 GPUs)", flush=True)
        write_report(report, args.json)
    for name in [] if args.skip_trace else args.towers:
        args.trace_tower = name
        groups = report["groups"].setdefault(name, {})
        for ranks in args.ranks:
            groups[str(ranks)] = run_group(_tower_rank, ranks, args)
            print(f"{name}, {ranks} rank(s): {groups[str(ranks)]}", flush=True)
        if "1" in groups and len(groups) > 1:
            one = groups["1"]["requests_per_s"]
            ratios = {ranks: round(group["requests_per_s"] / one, 3) for ranks, group in groups.items()}
            report.setdefault("throughput_vs_1_rank", {})[name] = ratios
            print(f"{name} throughput vs 1 rank: {ratios} (target >= 1.8 on 2 GPUs)", flush=True)
        write_report(report, args.json)
    if args.vlm_requests:
        report["vlm"] = {str(ranks): run_group(_vlm_rank, ranks, args) for ranks in args.ranks}
        first = report["vlm"][str(args.ranks[0])]["first_tokens"]
        for ranks, group in report["vlm"].items():
            group["first_tokens_equal_to_first_group"] = sum(a == b for a, b in zip(group.pop("first_tokens"), first))
            print(f"whole VLM, {ranks} rank(s): {group}", flush=True)
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
