"""Demo: a packed-varlen ViT compiled with ``backend="vgraph"``, fed a stream of random image mixes.

Prints the bucket table (hits, padding), eager fallbacks, and eager vs vgraph median latency per bucket.
CPU (fp32, small model) by default; CUDA (bf16, a ViT-L-sized model, CUDA graphs) when a GPU is present.
Checks itself and exits 1 when a call that fits a bucket was not served by one, or when an output is further from
eager than the dtype's tolerance.

    python examples/demo.py [--requests 24] [--device cuda|cpu] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time

import torch

import vgraph_compile
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

SETTINGS = {
    "cpu": dict(
        model=dict(patch_dim=588, dim=128, depth=4, heads=4, out_dim=256, merge=4),
        dtype=torch.float32,
        budgets=[256, 512, 1024, 2048],
        max_side=24,
        tolerance=1e-5,
    ),
    "cuda": dict(
        model=dict(patch_dim=1176, dim=1024, depth=24, heads=16, out_dim=2048, merge=4),
        dtype=torch.bfloat16,
        budgets=[1024, 2048, 4096, 8192, 16384],
        max_side=96,
        tolerance=2e-2,
    ),
}


def random_request(rng: random.Random, max_side: int) -> list[int]:
    """Patch counts of 1-4 images, each an even h x w grid of patches (2x2 merge), sides 8..max_side."""
    return [rng.randrange(8, max_side + 1, 2) * rng.randrange(8, max_side + 1, 2) for _ in range(rng.randint(1, 4))]


def timed(fn, device: torch.device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    device = torch.device(args.device)
    setting = SETTINGS[device.type]
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = PackedViT(**setting["model"]).to(device, setting["dtype"]).eval()
    patch_dim = setting["model"]["patch_dim"]
    compiled = torch.compile(
        model, backend="vgraph", dynamic=True, options={"token_budgets": setting["budgets"], "max_segments": 8}
    )
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, "
        f"{setting['dtype']}, budgets {setting['budgets']}"
    )

    requests = [random_request(rng, setting["max_side"]) for _ in range(args.requests)]
    requests.append([setting["budgets"][-1] + 64])  # one image over the largest budget: eager fallback
    served_before = vgraph_compile.counters.replays
    with torch.inference_mode():
        _, warmup_ms = timed(
            lambda: compiled(*pack_images(requests[0], patch_dim, device=device, dtype=setting["dtype"])), device
        )
        print(f"warm-up (trace, compile and capture every bucket): {warmup_ms / 1e3:.1f} s")
        runtime = vgraph_compile.runtimes()[-1]
        per_bucket: dict[object, dict[str, list[float]]] = {}
        worst = 0.0
        for lengths in requests:
            inputs = pack_images(lengths, patch_dim, device=device, dtype=setting["dtype"])
            tokens = sum(lengths)
            bucket = next((b for b in setting["budgets"] if b >= tokens), "eager")
            eager_out, eager_ms = timed(lambda: model(*inputs), device)
            vgraph_out, vgraph_ms = timed(lambda: compiled(*inputs), device)
            worst = max(worst, ((vgraph_out.float() - eager_out.float()).norm() / eager_out.float().norm()).item())
            times = per_bucket.setdefault(bucket, {"eager": [], "vgraph": []})
            times["eager"].append(eager_ms)
            times["vgraph"].append(vgraph_ms)

    print("\nbuckets (hits and padding over the stream):")
    print(runtime.stats_table())
    print(f"\nmax relative difference vs eager: {worst:.2e}")
    served = vgraph_compile.counters.replays - served_before
    in_budget = 1 + sum(sum(lengths) <= setting["budgets"][-1] for lengths in requests)
    print(f"\n{'bucket':>8} {'calls':>6} {'eager ms':>9} {'vgraph ms':>10} {'speed-up':>9}")
    for bucket, times in sorted(per_bucket.items(), key=lambda item: (isinstance(item[0], str), item[0])):
        eager_ms, vgraph_ms = statistics.median(times["eager"]), statistics.median(times["vgraph"])
        print(f"{bucket:>8} {len(times['eager']):>6} {eager_ms:>9.2f} {vgraph_ms:>10.2f} {eager_ms / vgraph_ms:>8.2f}x")
    if device.type == "cpu":
        print(
            "\n(On the CPU there is no kernel-launch overhead for graphs to remove, and padded rows cost full compute,"
            "\n so this shows correctness and bucketing; the speed-up is measured on a GPU: see BENCHMARKS.md.)"
        )
    failures = []
    if served != in_budget:
        failures.append(f"{served} calls served by buckets, expected {in_budget} (the warm-up and every request that fits)")
    if not worst <= setting["tolerance"]:
        failures.append(f"max relative difference {worst:.2e} over the {setting['dtype']} tolerance {setting['tolerance']}")
    if failures:
        sys.exit("demo check failed: " + "; ".join(failures))
    print(f"check: {served} calls served by buckets, outputs within {setting['tolerance']} of eager")


if __name__ == "__main__":
    main()
