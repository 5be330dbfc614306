"""Fixed-tile vision towers (released sizes, random weights, bf16): vgraph tile buckets vs the stock tower and
torch.compile, at N = 1, 4, 7 and 13 tiles, all systems in one process.

Towers (``--towers``): SigLIP-So400m 384 px as Idefics3 builds it (729 tokens a tile), InternViT-300M 448 px
(InternVL3, 1,025 tokens a tile with the CLS row), SigLIP So400m 896 px (Gemma 3, 4,096 tokens a tile).

Systems:
- ``hf_eager``: the stock tower (sdpa);
- ``torch_compile_default``: ``torch.compile(tower)`` (inductor, default mode; dynamo decides when to go dynamic);
- ``torch_compile_reduce_overhead_exact``: per N, a fresh ``torch.compile(tower, mode="reduce-overhead",
  dynamic=False)`` compiled for exactly that shape (the oracle; CUDA only: it records inductor's CUDA graph trees);
- ``vgraph``: ``compile_tile_tower(tower)`` with the library's buckets (1..8, then 1.25x up to 32 tiles).
Per system and N: median latency (``median_ms``), the first call's time (``first_call_s``: compiles and captures
it triggers), MFU against the measured bf16 matmul peak (CUDA), and the bf16 relative error of its output against
the fp32 tower. vgraph's warm-up (``warmup_s``) is its first call, which compiles once and captures every bucket.

    python benchmarks/hf_tiles.py [--towers idefics3-384 internvit-448 gemma3-896] [--json PATH]
    python benchmarks/hf_tiles.py --toy            # the harness on the CPU at toy sizes (timings not comparable)
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from vgraph_compile.bench.flops import matmul_peak_tflops
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.tile_towers import TILE_TOWERS, build_tile_tower
from vgraph_compile.bench.timing import median_ms, synchronize
from vgraph_compile.counters import counters
from vgraph_compile.hf.tiles import compile_tile_tower

TILES = (1, 4, 7, 13)
TOWERS = {name: TILE_TOWERS[name] for name in ("idefics3-384", "internvit-448", "gemma3-896")}
"""The towers this benchmark times (``bench.tile_towers``)."""
SYSTEMS = ("hf_eager", "torch_compile_default", "torch_compile_reduce_overhead_exact", "vgraph")


def tile_flops(tower: torch.nn.Module) -> float:
    """Matmul and attention FLOPs of one tile: patch embedding, q/k/v/o and MLP projections, QK^T and PV."""
    config = tower.config
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    tokens = (size // patch) ** 2
    width, mlp = config.hidden_size, config.intermediate_size
    per_layer = 2 * tokens * width * (4 * width + 2 * mlp) + 4 * tokens * tokens * width
    return per_layer * config.num_hidden_layers + 2 * tokens * 3 * patch * patch * width


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return ((output.float() - reference.float()).norm() / reference.float().norm()).item()


def _timed_first_call(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def run_tower(name: str, args, device: str, dtype: torch.dtype, peak: float | None) -> dict[str, Any]:
    tower = build_tile_tower(name, args.toy, dtype, device)
    reference = build_tile_tower(name, args.toy, torch.float32, device)
    reference.load_state_dict(tower.state_dict())
    config = tower.config
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    inputs = {n: torch.randn(n, 3, size, size, device=device, dtype=dtype) for n in TILES}
    with torch.inference_mode():
        expected = {n: reference(inputs[n].float()).last_hidden_state for n in TILES}
    flops = tile_flops(tower)
    report: dict[str, Any] = {"tile_gflops": round(flops / 1e9, 2), "systems": {}}

    def measure(system: str, call_for: Callable[[int], Callable[[], Any]], first: dict[int, float]) -> dict:
        rows = {}
        for n in TILES:
            call = call_for(n)
            with torch.inference_mode():
                output, first_s = _timed_first_call(call, device)
                error = relative_error(output.last_hidden_state, expected[n])  # before a replay overwrites it
                ms = median_ms(call, repeats=args.repeats, warmup=2, device=device)
            rows[str(n)] = {
                "median_ms": round(ms, 3),
                "first_call_s": round(first.get(n, first_s), 2),
                "rel_err_vs_fp32": round(error, 5),
                **({"mfu": round(flops * n / (ms * 1e-3) / (peak * 1e12), 3)} if peak else {}),
            }
            print(f"{name} {system} N={n}: {rows[str(n)]}", flush=True)
        report["systems"][system] = {"by_tiles": rows}
        return report["systems"][system]

    measure("hf_eager", lambda n: lambda: tower(inputs[n]), {})
    if "torch_compile_default" in args.systems:
        torch._dynamo.reset()
        default = torch.compile(tower)
        measure("torch_compile_default", lambda n: lambda: default(inputs[n]), {})
    if "torch_compile_reduce_overhead_exact" in args.systems and device == "cuda":
        exact: dict[int, Callable] = {}

        def oracle(n: int) -> Callable[[], Any]:
            torch._dynamo.reset()
            exact[n] = torch.compile(tower, mode="reduce-overhead", dynamic=False)
            return lambda: exact[n](inputs[n])

        measure("torch_compile_reduce_overhead_exact", oracle, {})
    elif device != "cuda":
        report["systems"]["torch_compile_reduce_overhead_exact"] = "CUDA only: it records inductor's CUDA graph trees"
    torch._dynamo.reset()
    compiled = compile_tile_tower(tower, compiler=args.compiler)
    with torch.inference_mode():
        _, warmup_s = _timed_first_call(lambda: compiled(inputs[TILES[0]]), device)
    before = counters.snapshot()
    served = measure("vgraph", lambda n: lambda: compiled(inputs[n]), {TILES[0]: warmup_s})
    after = counters.snapshot()
    served["warmup_s"] = round(warmup_s, 2)
    served["buckets"] = [bucket.shape.budget for bucket in compiled.runtimes[0].buckets]
    served["counters_after_warmup"] = {
        key: after[key] - before[key] for key in ("traces", "compiles", "graphs_captured", "replays", "eager_fallbacks")
    }
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", nargs="+", choices=sorted(TOWERS), default=list(TOWERS))
    parser.add_argument("--toy", action="store_true", help="tiny towers on the CPU (fp32): checks the harness")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="hf_eager and vgraph always run"
    )
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--json", help="default: benchmarks/results/tiles_<device>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.toy and not torch.cuda.is_available():
        raise SystemExit("hf_tiles.py times bf16 towers on a CUDA GPU and none is visible: run it there, or --toy")
    device = "cpu" if args.toy else "cuda"
    dtype = torch.float32 if args.toy else torch.bfloat16
    name = "cpu_toy" if args.toy else torch.cuda.get_device_name().split()[-1].lower()
    peak = None if args.toy else matmul_peak_tflops()
    report: dict[str, Any] = {
        "device": "cpu" if args.toy else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "tiles": list(TILES),
        "matmul_peak_tflops": round(peak, 1) if peak else None,
        "towers": {},
    }
    for tower in args.towers:
        report["towers"][tower] = run_tower(tower, args, device, dtype, peak)
    write_report(report, args.json or f"benchmarks/results/tiles_{name}.json")
    return report


if __name__ == "__main__":
    main()
