"""Never slower than the stock tower: every tower at its cases, the stock tower against vgraph, and the choice made
per case; then a random mix of requests under every ``call_choice``.

Towers (``--towers``; released sizes, random weights, bf16):
- packed, ``compile_vision_tower`` with the library's budgets: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``,
  ``glm4v``, ``paddleocr_vl`` (``models.vision_utils_towers.build_tower``), at small (1x224^2), medium (4x336^2),
  1x1344^2, 1x1792^2 and a video (16 frames of 336^2; a tower served on images only records it as skipped, with
  the reason);
- fixed tiles, ``compile_tile_tower``: ``so400m-384`` (``SiglipVisionModel`` with its MAP head),
  ``internvit-448``, ``gemma3-896`` (``bench.tile_towers``), at N = 1, 4, 7, 13 tiles.

Per case: the stock tower's median ms (sdpa, as the user has it), vgraph's median ms under ``call_choice=
"measured"`` (``vgraph_ms``) and padded to the smallest bucket (``padded_ms``, the fixed default), the speedup of
each over stock, and the choices the measured runtime made while the case was timed (its first call of a bucket
runs the stock tower, timed). A case below 1.00x is listed under ``slower``.

``--mix N`` (default 200; 0 skips it): N seeded random requests (``bench.workload.random_requests``: 1-4 images of
224-1344 px, some with a short video) through ``--mix-tower`` under each call_choice (``smallest_bucket``,
``exact_size``, ``stock`` and ``measured``, one runtime switched between them), each request timed: the totals,
the best fixed choice, and ``measured`` over it (the target: at most 0.95).

``--profile``: torch.profiler of the stock tower and of vgraph on ``--mix-tower`` at 1x1792^2, device time split
into attention, GEMMs and the rest (``kernel_split``).

``--fa4`` records a run with FlashAttention-4 installed (refused when it is not); the report then goes to
``never_slower_<device>_fa4.json``. Without it the report says whether FA4 was installed anyway.

    python benchmarks/never_slower.py                                   # every tower (about 20 min on an H100)
    python benchmarks/never_slower.py --towers qwen3_vl so400m-384      # a subset (each tower 1-3 min)
    python benchmarks/never_slower.py --toy                             # tiny towers on the CPU: the logic only

Writes ``benchmarks/results/never_slower_<device>[_fa4].json`` unless ``--json`` names another path.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import pathlib
import time
from typing import Any, Callable

import torch

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.tile_towers import build_tile_tower
from vgraph_compile.bench.timing import elapsed_ms, median_ms, synchronize
from vgraph_compile.bench.workload import CASES_PX, random_requests, to_grid
from vgraph_compile.config import CALL_CHOICES
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.hf.tiles import compile_tile_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower

RESULTS = pathlib.Path(__file__).parent / "results"
PACKED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "paddleocr_vl")
TILED = ("so400m-384", "internvit-448", "gemma3-896")
PACKED_CASES = {
    "small 1x224^2": CASES_PX["1x224^2"],
    "medium 4x336^2": CASES_PX["4x336^2"],
    "1x1344^2": CASES_PX["1x1344^2"],
    "1x1792^2": [(1, 1792, 1792)],
    "video 16f 336^2": CASES_PX["video 16f 336^2"],
}
TILES = (1, 4, 7, 13)
TOY_SCALE = 8
"""``--toy``: each packed case's sides divided by this."""
TOY_BUDGETS = {"min_tokens": 64, "max_tokens": 1024}
MIX_CHOICES = tuple(sorted(CALL_CHOICES, key=lambda choice: choice == "measured"))
"""Every call_choice, the measured one last (the fixed ones first: its stock timings do not warm them)."""
ATTENTION = ("flash", "fmha", "attention", "sdpa", "attn", "softmax")
GEMM = ("gemm", "matmul", "xmma", "cutlass", "nvjet", "cublas", "mm_", "addmm", "linear")


def kernel_split(events: dict[str, float]) -> dict[str, float]:
    """Device ms per kernel name -> ms of attention, GEMMs and the rest (by the kernel's name; attention first,
    so a fused attention kernel built on a GEMM template counts as attention)."""
    split = {"attention": 0.0, "gemm": 0.0, "rest": 0.0}
    for name, ms in events.items():
        lowered = name.lower()
        kind = "attention" if any(k in lowered for k in ATTENTION) else "gemm" if any(k in lowered for k in GEMM) else "rest"
        split[kind] += ms
    return {kind: round(ms, 3) for kind, ms in split.items()}


def choice_counts(runtimes) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for runtime in runtimes:
        counts.update(runtime.choices)
    return counts


def set_call_choice(served, choice: str) -> None:
    for runtime in served.runtimes:
        runtime.call_choice = choice


def compare(stock: Callable[[], Any], served, call: Callable[[], Any], args) -> dict[str, Any]:
    """One case: the stock tower, vgraph padded to the smallest bucket, and vgraph by the measured choice."""
    repeats, warmup, device = args.repeats, args.warmup, args.device
    stock_ms = median_ms(stock, repeats, warmup, device)
    set_call_choice(served, "smallest_bucket")
    padded_ms = median_ms(call, repeats, warmup, device)
    set_call_choice(served, "measured")
    before = choice_counts(served.runtimes)
    vgraph_ms = median_ms(call, repeats, warmup, device)
    choices = choice_counts(served.runtimes) - before
    return {
        "stock_ms": round(stock_ms, 3),
        "padded_ms": round(padded_ms, 3),
        "vgraph_ms": round(vgraph_ms, 3),
        "speedup": round(stock_ms / vgraph_ms, 3),
        "padded_speedup": round(stock_ms / padded_ms, 3),
        "choices": dict(choices),
    }


_BUILT: dict[str, tuple] = {}
"""The ``--mix-tower`` once built, for the mix and the profile after the cases."""


def packed_tower(name: str, args) -> tuple[torch.nn.Module, Any, Callable]:
    """(stock tower, vgraph tower with call_choice="measured", warmed up, grid maker) for a packed family; the
    mix tower is built once."""
    if name in _BUILT:
        return _BUILT[name]
    tower = build_tower(name, tiny=args.toy, device=args.device, dtype=args.dtype)
    options = {"compiler": "eager", **TOY_BUDGETS} if args.toy else {}
    served = compile_vision_tower(tower, max_items=8, max_frames=16, call_choice="measured", **options)
    with torch.inference_mode():
        served.warmup()
    geometry = served.geometry
    scale = TOY_SCALE if args.toy else 1

    def grid_of(items_px):
        items = [(frames, h // scale, w // scale) for frames, h, w in items_px]
        grid = to_grid(items, geometry.patch_size, geometry.temporal_patch_size, geometry.spatial_merge_size)
        return torch.tensor(grid)

    if name == args.mix_tower and (args.mix or args.profile):
        _BUILT[name] = tower, served, grid_of
    return tower, served, grid_of


def packed_inputs(served, grid_thw: torch.Tensor, args) -> torch.Tensor:
    rows = int(grid_thw.prod(-1).sum())
    return torch.randn(served.interface.pixel_values_shape(rows), device=args.device).to(args.dtype)


def run_packed(name: str, args) -> dict[str, Any]:
    start = time.perf_counter()
    tower, served, grid_of = packed_tower(name, args)
    synchronize(args.device)
    report: dict[str, Any] = {"warmup_s": round(time.perf_counter() - start, 1), "cases": {}}
    images_only = served.interface.video_failure
    with torch.inference_mode():
        for case, items_px in PACKED_CASES.items():
            grid_thw = grid_of(items_px)
            if images_only and bool((grid_thw[:, 0] > 1).any()):
                report["cases"][case] = {"skipped": f"images only: {images_only}"}
                continue
            x, on_device = packed_inputs(served, grid_thw, args), grid_thw.to(args.device)
            row = compare(lambda: tower(x, on_device), served, lambda: served(x, grid_thw), args)
            report["cases"][case] = {"patches": int(grid_thw.prod(-1).sum()), **row}
            print(f"{name} {case}: {report['cases'][case]}", flush=True)
    report["kernels"] = {str(g): k for r in served.runtimes for g, k in r.encoder.kernels.items()}
    report["stats"] = served.stats_table()
    return report


def run_tiled(name: str, args) -> dict[str, Any]:
    tower = build_tile_tower(name, args.toy, args.dtype, args.device)
    start = time.perf_counter()
    served = compile_tile_tower(tower, call_choice="measured", **({"compiler": "eager"} if args.toy else {}))
    size = tower.config.image_size if isinstance(tower.config.image_size, int) else tower.config.image_size[0]
    inputs = {n: torch.randn(n, 3, size, size, device=args.device, dtype=args.dtype) for n in TILES}
    with torch.inference_mode():
        served(inputs[TILES[1]])
        synchronize(args.device)
        report: dict[str, Any] = {"warmup_s": round(time.perf_counter() - start, 1), "cases": {}}
        for n in TILES:
            row = compare(lambda: tower(inputs[n]), served, lambda: served(inputs[n]), args)
            report["cases"][f"N={n}"] = row
            print(f"{name} N={n}: {row}", flush=True)
    report["buckets"] = [bucket.shape.budget for runtime in served.runtimes for bucket in runtime.buckets]
    report["stats"] = served.stats_table()
    return report


def run_mix(args) -> dict[str, Any]:
    """The seeded requests through one runtime under each call_choice: per-request device ms, summed."""
    tower, served, grid_of = packed_tower(args.mix_tower, args)
    requests = []
    for items_px in random_requests(args.seed, args.mix):
        grid_thw = grid_of(items_px)
        requests.append((packed_inputs(served, grid_thw, args), grid_thw))
    totals, choices = {}, {}
    with torch.inference_mode():
        for choice in MIX_CHOICES:
            set_call_choice(served, choice)
            for x, grid_thw in requests[: args.mix_warmup]:  # the measured choice times the stock tower here
                served(x, grid_thw)
            before = choice_counts(served.runtimes)
            totals[choice] = round(sum(elapsed_ms(lambda: served(x, g), args.device) for x, g in requests), 2)
            choices[choice] = dict(choice_counts(served.runtimes) - before)
            print(f"mix {choice}: {totals[choice]} ms {choices[choice]}", flush=True)
    fixed = {choice: total for choice, total in totals.items() if choice != "measured"}
    best = min(fixed, key=fixed.get)
    return {
        "tower": args.mix_tower,
        "requests": args.mix,
        "seed": args.seed,
        "total_ms": totals,
        "choices": choices,
        "best_fixed": best,
        "measured_over_best_fixed": round(totals["measured"] / fixed[best], 3),
    }


def profile_split(fn: Callable[[], Any], device: str) -> dict[str, float]:
    """Device ms per call of ``fn`` by kind of kernel (``kernel_split``), from one profiled call after a warm one."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    times = collections.Counter()
    for event in prof.key_averages():
        ms = (event.device_time_total if device == "cuda" else event.self_cpu_time_total) / 1e3
        if ms > 0 and (device == "cuda" or event.key.startswith("aten::")):
            times[event.key] += ms
    return kernel_split(times)


def run_profile(args) -> dict[str, Any]:
    tower, served, grid_of = packed_tower(args.mix_tower, args)
    grid_thw = grid_of(PACKED_CASES["1x1792^2"])
    x, on_device = packed_inputs(served, grid_thw, args), grid_thw.to(args.device)
    with torch.inference_mode():
        split = {"stock": profile_split(lambda: tower(x, on_device), args.device)}
        for choice in ("smallest_bucket", "exact_size"):
            set_call_choice(served, choice)
            split[f"vgraph {choice}"] = profile_split(lambda: served(x, grid_thw), args.device)
    return {"tower": args.mix_tower, "case": "1x1792^2", "ms": split}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", nargs="+", choices=PACKED + TILED, default=list(PACKED + TILED))
    parser.add_argument("--mix", type=int, default=200, help="random requests for the call_choice mix (0: skip)")
    parser.add_argument("--mix-tower", choices=PACKED, default="qwen3_vl")
    parser.add_argument("--mix-warmup", type=int, default=20, help="requests run before each choice is timed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="per-kernel split of --mix-tower at 1x1792^2")
    parser.add_argument("--fa4", action="store_true", help="a run with FlashAttention-4 installed")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--toy", action="store_true", help="tiny towers on the CPU (fp32): checks the logic")
    parser.add_argument("--json", help="report path (default: benchmarks/results/never_slower_<device>.json)")
    return parser.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    fa4_installed = importlib.util.find_spec("flash_attn") is not None and (
        importlib.util.find_spec("flash_attn.cute") is not None
    )
    if args.fa4 and not fa4_installed:
        raise SystemExit("--fa4: FlashAttention-4 is not installed (pip install flash-attn-4); run without --fa4")
    if not args.toy and not torch.cuda.is_available():
        raise SystemExit("never_slower.py times bf16 towers on a CUDA GPU and none is visible: run it there, or --toy")
    args.device = "cpu" if args.toy else "cuda"
    args.dtype = torch.float32 if args.toy else torch.bfloat16
    tag = "cpu" if args.toy else torch.cuda.get_device_name().split()[-1].lower()
    report: dict[str, Any] = {
        "device": "cpu" if args.toy else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "fa4_installed": fa4_installed,
        "toy": args.toy,
        "towers": {},
    }
    for name in sorted(args.towers, key=lambda name: name == args.mix_tower):  # the mix tower last: kept built
        torch._dynamo.reset()
        try:
            report["towers"][name] = run_packed(name, args) if name in PACKED else run_tiled(name, args)
        except Exception as error:  # a tower that breaks is reported, never dropped
            report["towers"][name] = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            print(f"{name} failed: {report['towers'][name]['failed']}", flush=True)
        gc.collect()  # the tower, its graphs and their pool, before the next tower is built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report["slower"] = [
        f"{name} {case}: {row['speedup']}x ({', '.join(row['choices'])})"
        for name, tower in report["towers"].items()
        for case, row in tower.get("cases", {}).items()
        if "speedup" in row and row["speedup"] < 1.0
    ]
    if args.mix:
        report["mix"] = run_mix(args)
    if args.profile:
        report["profile"] = run_profile(args)
    path = args.json or str(RESULTS / f"never_slower_{tag}{'_fa4' if args.fa4 else ''}.json")
    write_report(report, path)
    print(f"slower than stock: {report['slower'] or 'none'}; written to {path}")
    return report


if __name__ == "__main__":
    main()
