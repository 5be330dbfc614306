"""Real-size Qwen vision towers (random weights, bf16) on CUDA: vgraph vs the stock Hugging Face tower.

Checks, then times, one tower per run:
- bf16 outputs of ``compile_vision_tower`` and of the eager tower, both against the fp32 tower (relative error);
- 50 random batches after warm-up: no dynamo retrace and no CUDA graph re-record;
- median latency (CUDA events) of HF eager (sdpa) and vgraph on the bench's fixed cases (1x224^2, 4x336^2, 3 mixed,
  1x1344^2, a 16-frame 336^2 video). The stock tower computes its metadata on grid_thw's device, so it gets
  grid_thw on the GPU.

    python benchmarks/hf_towers.py qwen2.5-vl [--json PATH] [--min-tokens N --max-tokens N --budget-growth G]

Budgets are the library's defaults unless any of the budget options is given (then the library's defaults fill
the others).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import cuda_graph_captures, median_ms
from vgraph_compile.bench.workload import CASES_PX, to_grid
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.models.qwen_towers import qwen_tower


def relative(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tower", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--json")
    parser.add_argument("--min-tokens", type=int, help="smallest budget (patches); default: the library's")
    parser.add_argument("--max-tokens", type=int, help="largest budget (patches); default: the library's")
    parser.add_argument("--budget-growth", type=float, help="ratio between budgets; default: the library's")
    args = parser.parse_args()
    budgets = {
        name: value
        for name, value in (
            ("min_tokens", args.min_tokens),
            ("max_tokens", args.max_tokens),
            ("budget_growth", args.budget_growth),
        )
        if value is not None
    }
    if not torch.cuda.is_available():
        raise SystemExit("hf_towers.py times CUDA graphs and no CUDA GPU is visible: run it on a machine with one")
    fp32 = qwen_tower(args.tower, dtype=torch.float32)
    bf16 = qwen_tower(args.tower, dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    patch = fp32.config.patch_size
    start = time.perf_counter()
    tower = compile_vision_tower(bf16, max_items=8, max_frames=16, **budgets)
    (width,) = tower.interface.pixel_shape
    with torch.inference_mode():
        tower.warmup()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start

    rng = random.Random(0)

    def grid_of(items_px):
        return torch.tensor(to_grid(items_px, patch, fp32.config.temporal_patch_size, fp32.config.spatial_merge_size))

    def random_batch():
        items = [(1, rng.randint(224, 1024), rng.randint(224, 1024)) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            items.append((rng.choice([4, 8, 16]), 336, 336))
        return grid_of(items)

    def pixels(grid_thw, dtype):
        return torch.randn(int(grid_thw.prod(-1).sum()), width, device="cuda", generator=None).to(dtype)

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tower": args.tower,
        "budgets": list(tower.vgraph_config.budgets),
        "warmup_s": round(warmup_s, 1),
        "errors": [],
        "cases": {},
    }
    with torch.inference_mode():
        for _ in range(10):
            grid_thw = random_batch()
            x = pixels(grid_thw, torch.float32)
            ref = fp32(x, grid_thw.cuda()).pooler_output
            eager = bf16(x.bfloat16(), grid_thw.cuda()).pooler_output
            out = tower(x.bfloat16(), grid_thw).pooler_output
            assert not out.isnan().any()
            report["errors"].append((round(relative(out, ref), 5), round(relative(eager, ref), 5)))
        graphs, traces = cuda_graph_captures(), len(tower.runtimes)
        for _ in range(50):
            grid_thw = random_batch()
            tower(pixels(grid_thw, torch.bfloat16), grid_thw)
        report["rerecords"] = cuda_graph_captures() - graphs
        report["retraces"] = len(tower.runtimes) - traces
        for case, items_px in CASES_PX.items():
            grid_thw = grid_of(items_px)
            x = pixels(grid_thw, torch.bfloat16)
            report["cases"][case] = {
                "patches": int(grid_thw.prod(-1).sum()),
                "hf_eager_sdpa_ms": round(median_ms(lambda: bf16(x, grid_thw.cuda())), 2),
                "vgraph_ms": round(median_ms(lambda: tower(x, grid_thw)), 2),
            }
    print(json.dumps(report, indent=1))
    print(tower.stats_table())
    write_report(report, args.json)


if __name__ == "__main__":
    main()
