"""Block graphs on the towers the whole-tower graph refuses (released sizes, random weights, bf16): vgraph vs the
stock tower.

For each family: the tower built from its own config class (``models.vision_utils_towers.build_tower``) and its inputs in
the family's layout (``tower_call``); ``compile_vision_tower`` must pick block graphs. Per case (1x224^2, 4x336^2,
1x1344^2, a 16-frame 336^2 video; skipped with the stock tower's error where it takes no video): the median
latency of the stock tower (sdpa) and of vgraph, their ratio, the relative error of both bf16 outputs against the
fp32 tower, and the replays and eager fall backs the timed calls made (a fall back is a failure of the tier).

    python benchmarks/hf_block_tier.py [cosmos3_edge lfm3_vl video_llama_3 ...] [--toy] [--json PATH]

The report is written to ``benchmarks/results/hf_block_tier_<device>.json`` unless ``--json`` names another path.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import median_ms
from vgraph_compile.bench.workload import to_grid
from vgraph_compile.counters import counters
from vgraph_compile.hf import CompiledBlockTower, compile_vision_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

RESULTS = pathlib.Path(__file__).parent / "results"
FAMILIES = ("cosmos3_edge", "lfm3_vl", "video_llama_3")
CASES = {
    "1x224^2": [(1, 224, 224)],
    "4x336^2": [(1, 336, 336)] * 4,
    "1x1344^2": [(1, 1344, 1344)],
    "video 16f 336^2": [(16, 336, 336)],
}
"""(frames, height px, width px) per item."""
TOY_SCALE = 4
"""``--toy``: each case's sides divided by this, on the tiny tower, so the CPU run stays short."""


def relative(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def device_tag(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"


def _cast(values, dtype):
    return tuple(value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                 for value in values)  # fmt: skip


def bench_family(name: str, device: torch.device, toy: bool, repeats: int, warmup: int) -> dict:
    fp32 = build_tower(name, tiny=toy, device=str(device), dtype=torch.float32)
    low = build_tower(name, tiny=toy, device=str(device), dtype=torch.bfloat16)
    low.load_state_dict(fp32.state_dict())
    options = {"compiler": "eager", "min_tokens": 64, "max_tokens": 2048} if toy else {}
    tower = compile_vision_tower(low, **options)
    if not isinstance(tower, CompiledBlockTower):
        raise SystemExit(f"{name}: compile_vision_tower chose {type(tower).__name__}, not block graphs")
    config, scale = low.config, TOY_SCALE if toy else 1
    temporal = getattr(config, "temporal_patch_size", 1) or 1
    result = {"tier_reason": tower.tier_reason, "cases": {}}

    def inputs(items_px):
        grid = to_grid([(f, h // scale, w // scale) for f, h, w in items_px], config.patch_size, temporal, 2)
        args, kwargs = tower_call(name, fp32, grid)
        return grid, args, kwargs

    start = time.perf_counter()
    with torch.inference_mode():
        _, args, kwargs = inputs(CASES["1x224^2"])
        tower(*_cast(args, torch.bfloat16), **kwargs)  # records the program, compiles and captures the buckets
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["warmup_s"] = round(time.perf_counter() - start, 1)
        for case, items_px in CASES.items():
            grid, args, kwargs = inputs(items_px)
            low_args = _cast(args, torch.bfloat16)
            try:
                ref = fp32(*args, **kwargs).last_hidden_state
            except Exception as error:  # the stock tower takes no video
                result["cases"][case] = {"skipped": f"stock tower: {type(error).__name__}: {error}"[:300]}
                continue
            stock = low(*low_args, **kwargs).last_hidden_state
            before = counters.snapshot()
            mine = tower(*low_args, **kwargs).last_hidden_state
            assert not mine.isnan().any()
            vgraph_ms = median_ms(lambda: tower(*low_args, **kwargs), repeats, warmup, device)
            stock_ms = median_ms(lambda: low(*low_args, **kwargs), repeats, warmup, device)
            after = counters.snapshot()
            result["cases"][case] = {
                "grid": grid,
                "rows": sum(t * h * w for t, h, w in grid),
                "hf_eager_sdpa_ms": round(stock_ms, 2),
                "vgraph_ms": round(vgraph_ms, 2),
                "speedup": round(stock_ms / vgraph_ms, 2),
                "vgraph_rel_error": round(relative(mine, ref), 5),
                "stock_bf16_rel_error": round(relative(stock, ref), 5),
                "replays": after["replays"] - before["replays"],
                "eager_fallbacks": after["eager_fallbacks"] - before["eager_fallbacks"],
            }
    result["stats"] = tower.stats_table()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--toy", action="store_true", help="the tiny towers on the CPU (timings not comparable)")
    parser.add_argument("--json", help="report path (default: benchmarks/results/hf_block_tier_<device>.json)")
    args = parser.parse_args(argv)
    if args.toy:
        device, repeats, warmup = torch.device("cpu"), 2, 1
    elif torch.cuda.is_available():
        device, repeats, warmup = torch.device("cuda"), 20, 3
    else:
        raise SystemExit("hf_block_tier.py times CUDA graphs and no CUDA GPU is visible (--toy runs on the CPU)")
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "toy": args.toy,
        "families": {},
    }
    for name in args.families:
        try:
            report["families"][name] = bench_family(name, device, args.toy, repeats, warmup)
        except ValueError as refusal:  # refused by every tier (with --toy: lfm3_vl's one block is a convolution)
            report["families"][name] = {"refused": str(refusal)}
    print(json.dumps(report, indent=1))
    write_report(report, args.json or str(RESULTS / f"hf_block_tier_{device_tag(device)}.json"))
    return report


if __name__ == "__main__":
    main()
