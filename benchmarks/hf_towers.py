"""The vision tower of any served ``vision_utils`` family (random weights, bf16): vgraph vs the stock tower.

Builds the family's tower at its released size from its own config class (``models.vision_utils_towers.build_tower``),
then, one tower per run:
- bf16 outputs of ``compile_vision_tower`` and of the stock tower, both against the fp32 tower (relative error of
  ``pooler_output``, or ``last_hidden_state`` for a tower without one), on random batches and per fixed case;
- random batches after warm-up: no dynamo retrace and no CUDA graph re-record;
- median latency of the stock tower (sdpa) and of vgraph on the bench's fixed cases (1x224^2, 4x336^2, 3 mixed,
  1x1344^2, a 16-frame 336^2 video, and one large image, 1x1792^2), and the MFU of vgraph per case (``bench.flops.tower_flops`` over the
  measured bf16 matmul rate). A family whose stock tower fails on videos (served on images only) records the
  video case as skipped, with the reason. The stock tower computes its metadata on grid_thw's device, so it gets
  grid_thw on the GPU.

    python benchmarks/hf_towers.py glm_ocr|qwen2_vl|ernie4_5_vl_moe|... [--json PATH] [--min-tokens N ...]
    python benchmarks/hf_towers.py qwen2_vl --toy   # the tiny tower on the CPU, cases at 1/4 the pixels a side

The report is written to ``benchmarks/results/hf_<family>_<device>.json`` unless ``--json`` names another path.
Budgets are the library's defaults unless any budget option is given (then the library's defaults fill the
others).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch

from vgraph_compile.bench.flops import matmul_peak_tflops, tower_flops
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import cuda_graph_captures, median_ms
from vgraph_compile.bench.workload import CASES_PX, to_grid
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower

RESULTS = pathlib.Path(__file__).parent / "results"
CASES = {**CASES_PX, "1x1792^2": [(1, 1792, 1792)]}
"""The bench's fixed cases and one large image (a document page); ``--toy`` runs the bench's cases only."""
TOY_SCALE = 4
"""``--toy``: each case's sides divided by this (56^2 ... 336^2), so the CPU run stays short."""
TOY_BUDGETS = {"min_tokens": 256, "max_tokens": 2048}
"""``--toy``: budgets for those cases (budget options given override them)."""


def relative(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def device_tag(device: torch.device) -> str:
    """``h200`` for an NVIDIA H200, ``cpu`` on the CPU: the results file's suffix."""
    return torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", help="a served transformers vision_utils family (model type), e.g. qwen2_vl")
    parser.add_argument("--json", help="report path (default: benchmarks/results/hf_<family>_<device>.json)")
    parser.add_argument("--toy", action="store_true", help="the tiny tower on the CPU (timings not comparable)")
    parser.add_argument("--min-tokens", type=int, help="smallest budget (patches); default: the library's")
    parser.add_argument("--max-tokens", type=int, help="largest budget (patches); default: the library's")
    parser.add_argument("--budget-growth", type=float, help="ratio between budgets; default: the library's")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    budgets = {
        name: value
        for name, value in (
            ("min_tokens", args.min_tokens),
            ("max_tokens", args.max_tokens),
            ("budget_growth", args.budget_growth),
        )
        if value is not None
    }
    if args.toy:
        device, scale, batches, repeats, warmup = torch.device("cpu"), TOY_SCALE, 2, 2, 1
        options = {"compiler": "eager", **TOY_BUDGETS, **budgets}
    elif torch.cuda.is_available():
        device, options, scale, batches, repeats, warmup = torch.device("cuda"), budgets, 1, 10, 20, 3
    else:
        raise SystemExit(
            "hf_towers.py times CUDA graphs and no CUDA GPU is visible (--toy runs the tiny tower on the CPU)"
        )
    fp32 = build_tower(args.family, tiny=args.toy, device=str(device), dtype=torch.float32)
    low = build_tower(args.family, tiny=args.toy, device=str(device), dtype=torch.bfloat16)
    low.load_state_dict(fp32.state_dict())
    start = time.perf_counter()
    tower = compile_vision_tower(low, max_items=8, max_frames=16, **options)
    with torch.inference_mode():
        tower.warmup()
    if device.type == "cuda":
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    interface, geometry = tower.interface, tower.geometry
    images_only = interface.video_failure is not None
    peak = matmul_peak_tflops() if device.type == "cuda" else None
    rng = random.Random(0)

    def grid_of(items_px):
        items = [(frames, h // scale, w // scale) for frames, h, w in items_px]
        grid = to_grid(items, geometry.patch_size, geometry.temporal_patch_size, geometry.spatial_merge_size)
        return torch.tensor(grid)

    def random_batch():
        items = [(1, rng.randint(224, 1024), rng.randint(224, 1024)) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2 and not images_only:
            items.append((rng.choice([4, 8, 16]), 336, 336))
        return grid_of(items)

    def pixels(grid_thw, dtype):
        return torch.randn(interface.pixel_values_shape(int(grid_thw.prod(-1).sum())), device=device).to(dtype)

    features = interface.outputs[0].name  # pooler_output, or last_hidden_state for a tower without one

    def pooled(module, x, grid_thw):
        return module(x, grid_thw.to(device))[features]

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tower": args.family,
        "tower_class": type(low).__name__,
        "toy": args.toy,
        "budgets": list(tower.vgraph_config.budgets),
        "warmup_s": round(warmup_s, 1),
        "bf16_matmul_peak_tflops": round(peak, 1) if peak else None,
        "errors": [],
        "cases": {},
    }
    with torch.inference_mode():
        for _ in range(batches):
            grid_thw = random_batch()
            x = pixels(grid_thw, torch.float32)
            ref = pooled(fp32, x, grid_thw)
            eager = pooled(low, x.bfloat16(), grid_thw)
            out = pooled(tower, x.bfloat16(), grid_thw)
            assert not out.isnan().any()
            report["errors"].append((round(relative(out, ref), 5), round(relative(eager, ref), 5)))
        graphs, traces = cuda_graph_captures() if device.type == "cuda" else 0, len(tower.runtimes)
        for _ in range(5 * batches):
            grid_thw = random_batch()
            tower(pixels(grid_thw, torch.bfloat16), grid_thw)
        report["rerecords"] = (cuda_graph_captures() if device.type == "cuda" else 0) - graphs
        report["retraces"] = len(tower.runtimes) - traces
        for case, items_px in (CASES_PX if args.toy else CASES).items():
            grid_thw = grid_of(items_px)
            if images_only and bool((grid_thw[:, 0] > 1).any()):
                report["cases"][case] = {"skipped": f"images only: {interface.video_failure}"}
                continue
            x = pixels(grid_thw, torch.float32)
            ref, mine = pooled(fp32, x, grid_thw), pooled(tower, x.bfloat16(), grid_thw)
            x = x.bfloat16()
            vgraph_ms = median_ms(lambda: tower(x, grid_thw), repeats, warmup, device)
            flops = tower_flops(low, grid_thw.tolist(), interface)
            report["cases"][case] = {
                "patches": int(grid_thw.prod(-1).sum()),
                "hf_eager_sdpa_ms": round(median_ms(lambda: low(x, grid_thw.to(device)), repeats, warmup, device), 2),
                "vgraph_ms": round(vgraph_ms, 2),
                "vgraph_rel_error": round(relative(mine, ref), 5),
                "flops": flops,
                "mfu": round(flops / vgraph_ms / 1e9 / peak, 3) if peak else None,
            }
    print(json.dumps(report, indent=1))
    print(tower.stats_table())
    write_report(report, args.json or str(RESULTS / f"hf_{args.family}_{device_tag(device)}.json"))
    return report


if __name__ == "__main__":
    main()
