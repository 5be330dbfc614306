"""Tight vs conservative window bounds on a Qwen2.5-VL-sized window-attention ViT (bf16, CUDA graphs).

Same model, same budgets; only the window group's segment capacity differs (tight: the geometry's proven bound;
conservative: the token budget, as vLLM sized it before PR #42796). Prints median ms per case, and eager.

    python benchmarks/window_bounds.py [--depth 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

import vgraph_compile
from vgraph_compile.bench.timing import median_ms
from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs
from vgraph_compile.sample_models.packed_vit import WindowedViT

CASES = {
    "1x224^2": [(1, 16, 16)],
    "4x336^2": [(1, 24, 24)] * 4,
    "3 mixed": [(1, 16, 16), (1, 36, 48), (1, 40, 30)],
    "1x1344^2": [(1, 96, 96)],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = (
        WindowedViT(
            patch_dim=1176, dim=1280, depth=args.depth, heads=16, out_dim=3584, full_attention_blocks=(7, 15, 23, 31)
        )
        .cuda()
        .to(torch.bfloat16)
        .eval()
    )
    systems = {"eager": model}
    for bound in ("tight", "conservative"):
        systems[bound] = vgraph_compile.encoder(
            model, token_budgets=(1024, 4096, 16384), geometry=QWEN25_GEOMETRY, max_items=8, window_bound=bound
        )
    results: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for case, grid in CASES.items():
            inputs = windowed_inputs(QWEN25_GEOMETRY, grid, 1176, device="cuda", dtype=torch.bfloat16)
            reference = model(*inputs).float()
            results[case] = {}
            for name, system in systems.items():
                out = system(*inputs).float()
                error = ((out - reference).norm() / reference.norm()).item()
                assert error < 2e-2 and not out.isnan().any(), f"{name} {case}: relative error {error}"
                results[case][name] = median_ms(lambda: system(*inputs), args.repeats)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, WindowedViT depth {args.depth} (bf16)")
    for name in ("tight", "conservative"):
        runtime = systems[name].vgraph.runtimes[0]
        print(f"{name}: " + "; ".join(bucket.shape.format(runtime.spec) for bucket in runtime.buckets))
    print(f"{'case':>10} {'eager':>8} {'tight':>8} {'conserv.':>9} {'conserv./tight':>15}")
    for case, row in results.items():
        print(
            f"{case:>10} {row['eager']:>8.2f} {row['tight']:>8.2f} {row['conservative']:>9.2f} "
            f"{row['conservative'] / row['tight']:>14.2f}x"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ms": results}, handle, indent=1
            )


if __name__ == "__main__":
    main()
