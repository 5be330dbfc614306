"""``vgraph-bench``: a Qwen vision tower under every runtime a user would consider, same work, one process.

Systems: ``hf_eager_sdpa`` (the stock tower), ``eager_varlen`` (the stock tower with vgraph's attention op, no
graphs), ``torch_compile_dynamic``, ``torch_compile_reduce_overhead``, ``exact_shape_oracle`` (vgraph with one
budget equal to the case: inductor + CUDA graph for exactly that shape; fixed cases only), ``vgraph`` (tight
bounds) and ``vgraph_conservative`` (window segments sized by the token budget, as vLLM before PR #42796).
Each system gets a wall-clock limit; one that does not finish is reported with how far it got.

    vgraph-bench [--tower qwen2.5-vl] [--systems vgraph hf_eager_sdpa ...] [--json PATH] [--plot PATH]
    vgraph-bench --merge a.json b.json --json all.json --plot all.png     # combine runs, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vgraph_compile.hf.towers import hidden_width
from vgraph_compile.runtime.runner import padded_fraction

__all__ = ["main", "trace", "median_ms", "CASES_PX"]

CASES_PX = {
    "1x224^2": [(1, 224, 224)],
    "4x336^2": [(1, 336, 336)] * 4,
    "3 mixed": [(1, 224, 224), (1, 448, 672), (1, 672, 448)],
    "1x1344^2": [(1, 1344, 1344)],
    "video 16f 336^2": [(16, 336, 336)],
}
"""Fixed cases as (frames, height px, width px) per item."""
SYSTEMS = (
    "hf_eager_sdpa",
    "eager_varlen",
    "torch_compile_dynamic",
    "torch_compile_reduce_overhead",
    "exact_shape_oracle",
    "vgraph",
    "vgraph_conservative",
)


def to_grid(items_px, patch: int, temporal: int, merge: int) -> list[tuple[int, int, int]]:
    """(t, h, w) in patches, as the processor resizes: sides rounded to multiples of patch x merge."""
    unit = patch * merge

    def patches(pixels: int) -> int:
        return max(1, round(pixels / unit)) * merge

    return [(max(1, frames // temporal), patches(h), patches(w)) for frames, h, w in items_px]


def trace(seed: int = 0, requests: int = 64) -> list[list[tuple[int, int, int]]]:
    """Requests of 1-4 images (sides 224-1344 px, aspect 1:2 to 2:1); one in six also carries a 336^2 video."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        items = []
        for _ in range(rng.randint(1, 4)):
            long_side = rng.randint(224, 1344)
            short_side = max(224, int(long_side / rng.uniform(1.0, 2.0)))
            h, w = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
            items.append((1, h, w))
        if rng.random() < 1 / 6:
            items.append((rng.choice([4, 8, 16]), 336, 336))
        out.append(items)
    return out


@dataclass
class Result:
    latencies_ms: list[float] = field(default_factory=list)
    cases_ms: dict[str, float] = field(default_factory=dict)
    warmup_s: float = 0.0
    recompiles: int = 0
    rerecords: int = 0
    peak_mem_gib: float = 0.0
    status: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        stats = {}
        if lat:
            stats = {
                "p50_ms": round(statistics.median(lat), 2),
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
                "mean_ms": round(statistics.mean(lat), 2),
            }
        return {
            **stats,
            "requests": len(lat),
            "warmup_s": round(self.warmup_s, 1),
            "recompiles": self.recompiles,
            "rerecords": self.rerecords,
            "peak_mem_gib": round(self.peak_mem_gib, 2),
            "status": self.status,
            **self.extra,
        }


def _event_ms(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """Median of ``repeats`` CUDA-event timings of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(_event_ms(fn) for _ in range(repeats))


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def matmul_peak_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10), the MFU denominator."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b, repeats=10) / 1e9


def tower_flops(tower, grid) -> float:
    """Matmul and attention FLOPs of one forward (the merger and patch embedding included)."""
    config = tower.config
    width = hidden_width(config)
    mlp = getattr(config, "intermediate_size", None) or width * getattr(config, "mlp_ratio", 4)
    gated = type(tower).__name__.startswith("Qwen2_5")
    tokens = sum(t * h * w for t, h, w in grid)
    frames = [h * w for t, h, w in grid for _ in range(t)]
    window = (config.window_size // config.patch_size) ** 2 if gated else None
    full_blocks = set(getattr(config, "fullatt_block_indexes", range(config.depth)))
    flops = 2 * tokens * width * (4 * width + (3 if gated else 2) * mlp) * config.depth
    for block in range(config.depth):
        segment = sum(f * f for f in frames) if (block in full_blocks or not gated) else tokens * window
        flops += 4 * segment * width
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    merged = tokens // config.spatial_merge_size**2
    out = getattr(config, "out_hidden_size", None) or config.hidden_size
    merge_width = width * config.spatial_merge_size**2
    return flops + 2 * tokens * patch_dim * width + 2 * merged * merge_width * (merge_width + out)


def run(args) -> dict[str, Any]:
    from vgraph_compile.hf import compile_vision_tower, routed_attention
    from vgraph_compile.models.qwen_towers import qwen_tower
    from vgraph_compile.runtime.cudagraph import recorded_graphs

    if not torch.cuda.is_available():
        raise SystemExit("vgraph-bench measures CUDA graphs: run it on a machine with a CUDA GPU")
    tower = qwen_tower(args.tower)
    config = tower.config
    merge = config.spatial_merge_size
    grid_of = lambda items: to_grid(items, config.patch_size, config.temporal_patch_size, merge)  # noqa: E731
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    requests = [grid_of(items) for items in trace(args.seed, args.requests)]
    cases = {name: grid_of(items) for name, items in CASES_PX.items()}

    def inputs(grid):
        grid_thw = torch.tensor(grid)
        return torch.randn(int(grid_thw.prod(-1).sum()), width, device="cuda", dtype=torch.bfloat16), grid_thw

    budgets = dict(min_tokens=args.min_tokens, max_tokens=16384, budget_growth=args.budget_growth)

    def stock(fn):
        return lambda x, grid_thw: fn(x, grid_thw.cuda())

    def routed(x, grid_thw):
        with routed_attention(tower):
            return tower(x, grid_thw.cuda())

    factories: dict[str, Callable[[], Callable]] = {
        "hf_eager_sdpa": lambda: stock(tower),
        "eager_varlen": lambda: routed,
        "torch_compile_dynamic": lambda: stock(torch.compile(tower, dynamic=True)),
        "torch_compile_reduce_overhead": lambda: stock(torch.compile(tower, mode="reduce-overhead")),
        "vgraph": lambda: compile_vision_tower(tower, max_items=8, max_frames=16, **budgets),
        "vgraph_conservative": lambda: compile_vision_tower(
            tower, max_items=8, max_frames=16, window_bound="conservative", **budgets
        ),
    }
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"{args.tower} vision tower (real config sizes, random weights, bf16)",
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "cases": CASES_PX,
            "budget_growth": args.budget_growth,
            "min_tokens": args.min_tokens,
        },
        "systems": {},
        "cases": {},
    }
    peak = matmul_peak_tflops()
    report["bf16_matmul_peak_tflops"] = round(peak, 1)
    for name in args.systems:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = Result()
        deadline = time.perf_counter() + args.time_limit
        with torch.inference_mode():
            try:
                if name == "exact_shape_oracle":
                    _oracle(tower, cases, inputs, result, deadline, args, compile_vision_tower)
                else:
                    _system(
                        name,
                        factories[name],
                        requests,
                        cases,
                        inputs,
                        result,
                        deadline,
                        args,
                        tower,
                        recorded_graphs,
                        peak,
                    )
            except TimeoutError as stop:
                result.status = f"did not finish in {args.time_limit} s: {stop}"
            except Exception as error:  # a system that breaks is reported, never dropped
                result.status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        result.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
        report["systems"][name] = result.summary()
        for case, ms in result.cases_ms.items():
            report["cases"].setdefault(case, {})[name] = round(ms, 2)
        print(f"{name}: {report['systems'][name]}", flush=True)
    return report


def _check_deadline(deadline: float, what: str) -> None:
    if time.perf_counter() > deadline:
        raise TimeoutError(what)


def _system(name, factory, requests, cases, inputs, result, deadline, args, tower, recorded_graphs, peak):
    start = time.perf_counter()
    fn = factory()
    if hasattr(fn, "warmup"):
        fn.warmup()
    fn(*inputs(requests[0]))
    torch.cuda.synchronize()
    result.warmup_s = time.perf_counter() - start
    for index, grid in enumerate(requests[:4]):  # first sight of typical shapes, outside the timed part
        fn(*inputs(grid))
        _check_deadline(deadline, f"warm-up, request {index}")
    graphs, unique = recorded_graphs(), _unique_graphs()
    host = []
    for index, grid in enumerate(requests):
        x, grid_thw = inputs(grid)
        result.latencies_ms.append(_event_ms(lambda: fn(x, grid_thw)))
        if hasattr(fn, "warmup"):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            fn(x, grid_thw)
            host.append((time.perf_counter() - begin) * 1e3)
        _check_deadline(deadline, f"{index + 1} of {len(requests)} requests timed")
    result.recompiles = _unique_graphs() - unique
    result.rerecords = recorded_graphs() - graphs
    for case, grid in cases.items():
        x, grid_thw = inputs(grid)
        result.cases_ms[case] = median_ms(lambda: fn(x, grid_thw), args.repeats, warmup=1)
        _check_deadline(deadline, f"case {case}")
    if hasattr(fn, "warmup"):
        stats = [bucket.stats for runtime in fn.runtimes for bucket in runtime.buckets]
        result.extra["padded_fraction"] = round(padded_fraction(stats), 3)
        result.extra["host_ms_per_call_p50"] = round(statistics.median(host), 3)
        result.extra["buckets"] = [runtime.stats_table() for runtime in fn.runtimes]
        flops = tower_flops(tower, cases["1x1344^2"])
        result.extra["mfu_1x1344"] = round(flops / result.cases_ms["1x1344^2"] / 1e9 / peak, 3)


def _oracle(tower, cases, inputs, result, deadline, args, compile_vision_tower):
    warmups = []
    for case, grid in cases.items():
        tokens = sum(t * h * w for t, h, w in grid)
        start = time.perf_counter()
        exact = compile_vision_tower(
            tower, token_budgets=[tokens], max_items=max(4, len(grid)), max_frames=max(16, sum(t for t, _, _ in grid))
        )
        x, grid_thw = inputs(grid)
        exact(x, grid_thw)
        torch.cuda.synchronize()
        warmups.append(time.perf_counter() - start)
        result.cases_ms[case] = median_ms(lambda: exact(x, grid_thw), args.repeats, warmup=0)
        _check_deadline(deadline, f"case {case}")
    result.warmup_s = statistics.mean(warmups)
    result.extra["warmup_is"] = "mean per case (one exact-shape compile each)"


def merge(paths: list[str]) -> dict[str, Any]:
    """One report from several runs of the same workload (systems and cases side by side)."""
    reports = [json.load(open(path)) for path in paths]
    merged = {key: value for key, value in reports[0].items() if key not in ("systems", "cases")}
    merged["systems"], merged["cases"] = {}, {}
    for report in reports:
        merged["systems"].update(report["systems"])
        for case, row in report["cases"].items():
            merged["cases"].setdefault(case, {}).update(row)
    return merged


def table(report: dict[str, Any]) -> str:
    lines = [f"{report['device']}, torch {report['torch']}, {report['model']}"]
    lines.append(
        f"{'system':>30} {'p50':>8} {'p99':>8} {'mean':>8} {'warmup s':>9} {'recomp':>7} {'rerec':>6} "
        f"{'mem GiB':>8}  status"
    )
    for name, row in report["systems"].items():
        lines.append(
            f"{name:>30} {row.get('p50_ms', '-'):>8} {row.get('p99_ms', '-'):>8} {row.get('mean_ms', '-'):>8} "
            f"{row['warmup_s']:>9} {row['recompiles']:>7} {row['rerecords']:>6} {row['peak_mem_gib']:>8}  "
            f"{row['status']}"
        )
    systems = list(report["systems"])
    lines.append("\n" + f"{'case ms':>16} " + " ".join(f"{name[:14]:>14}" for name in systems))
    for case, row in report["cases"].items():
        lines.append(f"{case:>16} " + " ".join(f"{row.get(name, '-'):>14}" for name in systems))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError as missing:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(report["cases"])
    systems = [name for name in report["systems"] if any(name in report["cases"][c] for c in cases)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    bar = 0.8 / max(1, len(systems))
    for index, name in enumerate(systems):
        values = [report["cases"][case].get(name, float("nan")) for case in cases]
        left.bar([c + index * bar for c in range(len(cases))], values, bar, label=name)
    left.set_xticks([c + 0.4 - bar / 2 for c in range(len(cases))], cases, rotation=15)
    left.set_ylabel("median ms per call")
    left.set_yscale("log")
    left.legend(fontsize=7)
    left.set_title(f"{report['model']}\n{report['device']}", fontsize=9)
    ratios = [
        report["cases"][c].get("vgraph", float("nan")) / report["cases"][c].get("exact_shape_oracle", float("nan"))
        for c in cases
    ]
    right.bar(cases, ratios)
    right.axhline(1.10, color="red", linestyle="--", label="1.10x target")
    right.set_ylabel("vgraph / exact-shape oracle")
    right.tick_params(axis="x", rotation=15)
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vgraph-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tower", default="qwen2.5-vl", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-growth", type=float, default=1.5)
    parser.add_argument("--min-tokens", type=int, default=256, help="smallest vgraph budget (patches)")
    parser.add_argument("--time-limit", type=float, default=240.0, help="wall seconds per system")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--merge", nargs="+", help="combine these JSON reports instead of running")
    args = parser.parse_args(argv)
    report = merge(args.merge) if args.merge else run(args)
    print(table(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
