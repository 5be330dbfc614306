"""How fast is the tower: every tower, stock against vgraph, each beside its roofline, on a seeded request mix and
fixed cases. The one speed benchmark for towers.

Towers (``--towers``, default all seven; released sizes, random weights, bf16):
- packed, ``compile_vision_tower(tower, max_items=8, max_frames=16)``: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``,
  ``glm4v``, ``paddleocr_vl`` (any other served ``vision_utils`` family by its model type too:
  ``sample_models.vision_utils_towers.build_tower``). Cases: a seeded mix of ``--requests`` requests
  (``bench.workload.random_requests(--seed, --requests)``: 1-4 images of 224-1344 px, one in six with a 4-16 frame
  336^2 video) and the fixed cases 1x224^2, 4x336^2, 1x1344^2, 1x1792^2 and a 16-frame 336^2 video. A tower served
  on images only records the fixed video as skipped, with the reason, and gets a mix request's video one frame per
  item, as its model's ``get_video_features`` passes it;
- fixed tiles, ``compile_tile_tower(tower)``: ``so400m-384`` (``SiglipVisionModel`` with its MAP head) and
  ``internvit-448`` (``bench.tile_towers``), at N = 1, 4 and 13 tiles.

Per case and per mix request:
- FLOPs, attention and the rest (``bench.flops``: counted under ``FlopCounterMode``; attention 4 * s^2 * width per
  attention segment of s rows per layer, windows counted as windows; linear layers 2 * rows * in * out), and the
  roofline: attention FLOPs at ``ATTENTION_TFLOPS`` (500) plus the rest at ``LINEAR_TFLOPS`` (650), in ms;
- the stock tower's median ms (HF eager, sdpa) and vgraph's (the tower warmed with ``warmup()`` first; per case
  ``--warmup`` untimed calls, then the median of ``--repeats`` CUDA-event timings), each over the roofline, and
  vgraph's speed-up over stock; vgraph's output against stock's (``rel_error_vs_stock``);
- the route vgraph took on the case's calls (``route``: calls per way: ``replay`` of the smallest bucket, a
  ``split`` over two buckets, the compiled code at the ``exact size``, the ``stock`` module, an ``eager`` fallback,
  ``several graph calls`` when the tower packed the items into more than one), the buckets replayed, and the
  attention kernels (``kernels``): per attention group, the one each replayed bucket captured (the compiled
  encoder's choice at its rows and segments), and under ``exact size`` those the calls outside a graph resolved.
Per packed tower, the mix's totals: stock, vgraph and roofline ms summed, vgraph / roofline, stock / roofline, the
share of stock's time removed (and the share the roofline would remove), the lowest per-request speed-up, and
every request below 1.00x stock. ``slower`` lists every case and request below 1.00x, per tower and for the run.

Profile (``--no-profile`` skips it): device ms in attention, GEMMs and the rest (``bench.kernel_profile``), stock
and vgraph, at 1x1344^2 and at the mix request of median patches (packed), at N=13 (tiles).

The install is read from what imports (``bench.install``): the GPU install (``vgraph-compile[cuda]`` or
``[cuda13]``: FlashAttention-4's ``flash_attn.cute`` and cudnn-frontend's ``cudnn``) or the plain one, with the
versions of torch, transformers, triton, flash-attn-4, nvidia-cutlass-dsl and nvidia-cudnn-frontend. ``--install
cuda`` / ``--install plain`` states which one the run is meant to be, and stops at once when the environment is the
other.

The report (JSON), written after every tower and every part of one, so a run cut short keeps what it measured:
``{benchmark, device, device_tag, date, install, install_tag, importable, versions, toy, roofline: {attention_tflops,
linear_tflops}, settings, towers: {name: {kind, tower_class, parameters_m, build_s, budgets, cases: {case: row |
{skipped}}, mix: {seed, requests: [row + grid], total}, profile: {case: {stock, vgraph}}, kernels, kernel_log, stats,
slower, elapsed_s} | {failed}}, skipped, slower, elapsed_s}``; a row is ``{patches | tiles, flops: {attention,
linear, total}, roofline_ms, stock_ms, vgraph_ms, stock_over_roofline, vgraph_over_roofline, speedup, route,
buckets, kernels, rel_error_vs_stock}``.

    python benchmarks/roofline.py --install plain      # every tower, the plain install (about 7 min on an H200)
    python benchmarks/roofline.py --install cuda       # the same with the GPU install
    python benchmarks/roofline.py --towers qwen3_vl so400m-384 --add   # these towers into the existing report
    python benchmarks/roofline.py --toy                # tiny towers on the CPU: the logic only (1-2 min)
    python benchmarks/roofline.py --table benchmarks/results/roofline_h200_*.json   # BENCHMARKS.md's tables

Writes ``benchmarks/results/roofline_<device>_<install>.json`` (``--toy``: ``roofline_cpu_toy.json`` in the
temporary directory) unless ``--json`` names another path. No tower starts after ``--deadline-s`` seconds
(default 420: with the slowest tower about 1.5 min, the run ends within 9); a tower not started is listed under
``skipped`` with the command that adds it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import pathlib
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch

from vgraph_compile.bench.flops import ATTENTION_TFLOPS, LINEAR_TFLOPS, FlopSplit, count_flops, tower_flop_split
from vgraph_compile.bench.install import device_record, install
from vgraph_compile.bench.kernel_profile import kernel_breakdown
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.tile_towers import TILE_TOWERS, build_tile_tower
from vgraph_compile.bench.timing import median_ms, synchronize
from vgraph_compile.bench.workload import CASES_PX, random_requests, to_grid
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.hf.whole_graph.tiles import compile_tile_tower
from vgraph_compile.serve.runtime import EXACT, PADDED, SPLIT, STOCK
from vgraph_compile.symbolic import evaluate

RESULTS = pathlib.Path(__file__).parent / "results"
PACKED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "paddleocr_vl")
TILED = ("so400m-384", "internvit-448")
PACKED_CASES = {
    "1x224^2": CASES_PX["1x224^2"],
    "4x336^2": CASES_PX["4x336^2"],
    "1x1344^2": CASES_PX["1x1344^2"],
    "1x1792^2": [(1, 1792, 1792)],
    "video 16f 336^2": CASES_PX["video 16f 336^2"],
}
"""The packed towers' fixed cases, (frames, height px, width px) per item."""
TILES = (1, 4, 13)
PROFILED_CASE = "1x1344^2"
PROFILED_TILES = 13
MAX_ITEMS, MAX_FRAMES = 8, 16
"""``compile_vision_tower``'s item and frame limits, as ``benchmarks/ttft.py`` serves a VLM's tower."""
TOY_SCALE = 8
"""``--toy``: each packed case's sides divided by this (the mix's too)."""
TOY_BUDGETS = {"min_tokens": 64, "max_tokens": 1024}
"""``--toy``: budgets that hold every scaled case and request."""
ROUTES = {PADDED: "replay", SPLIT: "split", EXACT: "exact size", STOCK: "stock"}
"""The runtime's per-call choices (``serve/runtime``) by their short names in ``route``."""
OTHER_ROUTES = ("eager", "stock tower", "several graph calls")
"""Routes counted outside the runtime's choices: an eager fallback (no bucket holds the call), a call the tower
itself sent to its stock module, and a call the tower packed into more than one graph call."""


# -- the route and the kernels of a case -----------------------------------------------------------------------


def _snapshot(served) -> dict[str, Any]:
    """The counters a route is read from: each runtime's choices, its buckets' hits and eager fallbacks, and the
    tower's own split and stock calls."""
    runtimes = list(served.runtimes)
    choices: collections.Counter = collections.Counter()
    for runtime in runtimes:
        choices.update(runtime.choices)
    return {
        "choices": choices,
        "hits": {
            (id(runtime), bucket.shape.budget): bucket.stats.hits for runtime in runtimes for bucket in runtime.buckets
        },
        "eager": sum(miss.count for runtime in runtimes for miss in runtime.misses.values()),
        "several graph calls": getattr(served, "split_calls", 0),
        "stock tower": getattr(served, "stock_calls", 0),
    }


def routes_since(served, before: dict[str, Any]) -> tuple[dict[str, int], list[tuple[Any, Any]]]:
    """(calls per route since ``before``, the (runtime, bucket) pairs replayed since then). A replay the runtime's
    choice did not count (``call_choice="smallest_bucket"`` counts none) is a ``replay``; each split replays two."""
    after = _snapshot(served)
    choices = after["choices"] - before["choices"]
    routes = collections.Counter({ROUTES.get(choice, choice): count for choice, count in choices.items()})
    replayed, hits = [], 0
    for runtime in served.runtimes:
        for bucket in runtime.buckets:
            gained = bucket.stats.hits - before["hits"].get((id(runtime), bucket.shape.budget), 0)
            if gained > 0:
                replayed.append((runtime, bucket))
                hits += gained
    routes["replay"] += hits - choices[PADDED] - 2 * choices[SPLIT]
    for route in OTHER_ROUTES:
        routes[route] += after[route] - before[route]
    return {route: count for route, count in sorted(routes.items()) if count > 0}, replayed


def _kernel_at(name: str, rows: int, segments: int, parameter: torch.Tensor) -> str:
    """The plain kernel an attention group's ``name`` (one kernel, or one per bucket's rows and segments:
    ``registry.by_rows``) gives a call of ``rows`` rows in ``segments`` segments; ``"default"``: its fixed rule."""
    from vgraph_compile.kernels import registry

    try:
        if name == "default":
            return registry.resolve(name, parameter.device, parameter.dtype).name
        return registry.pick(name, rows, segments)
    except Exception:  # a name this registry does not parse: reported as the encoder has it
        return name


@contextlib.contextmanager
def kernels_run() -> Iterator[set[str]]:
    """The kernels ``vgraph::varlen_attention`` resolves while the block runs (each call outside a graph replay,
    such as the compiled code at a call's exact sizes, resolves its kernel by its rows and segments)."""
    from vgraph_compile.kernels import registry

    names: set[str] = set()
    resolve = registry.resolve

    def recorded(*args, **kwargs):
        backend = resolve(*args, **kwargs)
        names.add(backend.name)
        return backend

    registry.resolve = recorded
    try:
        yield names
    finally:
        registry.resolve = resolve


def case_kernels(
    served, replayed: list[tuple[Any, Any]], routes: dict[str, int], unreplayed: set[str]
) -> dict[str, str]:
    """Where a case's attention ran: per attention group, the kernel each replayed bucket captured (at its rows and
    segment capacity; a group with no measured choice runs the config's fixed rule), and under ``exact size`` the
    kernels the calls run outside a graph resolved. A tower with no varlen attention runs its own SDPA."""
    parameter = next(served.tower.parameters())
    used: dict[str, set[str]] = collections.defaultdict(set)
    if any(not runtime.spec.groups for runtime in served.runtimes):
        used["tiles"].add("sdpa (the tower's own attention over the tile batch)")
    for runtime, bucket in replayed:
        for group in runtime.spec.groups:
            site = next(site for site in runtime.spec.sites if site.group == group.index)
            name = runtime.encoder.kernels.get(group.index)
            if name is None:
                backend = runtime.config.attention_backend
                name = "default" if backend == "auto" else backend
            rows = evaluate(site.rows, bucket.shape.values, "an attention site's rows")
            used[f"group {group.index}"].add(_kernel_at(name, rows, bucket.shape.segments[group.index], parameter))
    if unreplayed and "exact size" in routes:  # (on the CPU, a bucket's code runs outside a graph too)
        used["exact size"] = unreplayed
    return {group: " + ".join(sorted(names)) for group, names in sorted(used.items())}


# -- one case --------------------------------------------------------------------------------------------------


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return ((output.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()


def roofline_row(flops: FlopSplit, stock_ms: float, vgraph_ms: float) -> dict[str, Any]:
    """The FLOPs, the roofline, both times, each over the roofline, and vgraph's speed-up over stock."""
    roofline = flops.roofline_ms
    return {
        "flops": {"attention": flops.attention, "linear": flops.linear, "total": flops.total},
        "roofline_ms": float(f"{roofline:.5g}"),
        "stock_ms": round(stock_ms, 3),
        "vgraph_ms": round(vgraph_ms, 3),
        "stock_over_roofline": round(stock_ms / roofline, 3),
        "vgraph_over_roofline": round(vgraph_ms / roofline, 3),
        "speedup": round(stock_ms / vgraph_ms, 3),
    }


def measure(stock: Callable, vgraph: Callable, served, flops: FlopSplit, field: str, args) -> dict:
    """One case: vgraph (``--warmup`` untimed calls, the median of ``--repeats``; the route over all of them), then
    the stock tower the same way; the first output of each is compared."""
    before = _snapshot(served)
    with kernels_run() as unreplayed:
        mine = vgraph()
    served.capture_all()  # a tile count's first call may start its captures: none runs while timed
    vgraph_ms = median_ms(vgraph, args.repeats, args.warmup - 1, args.device)
    routes, replayed = routes_since(served, before)
    theirs = stock()
    stock_ms = median_ms(stock, args.repeats, args.warmup - 1, args.device)
    return {
        **roofline_row(flops, stock_ms, vgraph_ms),
        "route": routes,
        "buckets": sorted({bucket.shape.budget for _, bucket in replayed}),
        "kernels": case_kernels(served, replayed, routes, unreplayed),
        "rel_error_vs_stock": float(f"{relative_error(mine[field], theirs[field]):.3g}"),
    }


def profile_split(breakdown: dict[str, Any]) -> dict[str, Any]:
    """A ``kernel_breakdown`` as device ms in attention, GEMMs and the rest, with its top kernels and the rest's."""
    kinds, total = breakdown["by_kind_ms"], breakdown["device_ms_total"]
    attention, gemm = kinds.get("attention", 0.0), kinds.get("gemm", 0.0)
    return {
        "attention_ms": round(attention, 3),
        "gemm_ms": round(gemm, 3),
        "rest_ms": round(total - attention - gemm, 3),
        "total_ms": round(total, 3),
        "top": breakdown["top"][:8],
        "rest_top": [kernel for kernel in breakdown["top"] if kernel["kind"] not in ("attention", "gemm")][:12],
    }


def profile_pair(stock: Callable, vgraph: Callable, device: str) -> dict[str, Any]:
    """Stock and vgraph on one case (both already warm), one profiled call each."""
    return {
        system: profile_split(kernel_breakdown(fn, top=60, device=device))
        for system, fn in (("stock", stock), ("vgraph", vgraph))
    }


# -- totals ----------------------------------------------------------------------------------------------------


def mix_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The mix's sums of stock, vgraph and roofline ms, their ratios, the share of stock's time removed (by vgraph,
    and at the roofline), the lowest per-request speed-up and the requests below 1.00x stock."""
    stock = sum(row["stock_ms"] for row in rows)
    vgraph = sum(row["vgraph_ms"] for row in rows)
    roofline = sum(row["roofline_ms"] for row in rows)
    lowest = min(range(len(rows)), key=lambda index: rows[index]["speedup"])
    return {
        "requests": len(rows),
        "stock_ms": round(stock, 2),
        "vgraph_ms": round(vgraph, 2),
        "roofline_ms": float(f"{roofline:.5g}"),
        "vgraph_over_roofline": round(vgraph / roofline, 3),
        "stock_over_roofline": round(stock / roofline, 3),
        "share_of_stock_removed": round(1 - vgraph / stock, 3),
        "share_removed_at_roofline": round(1 - roofline / stock, 3),
        "lowest_speedup": rows[lowest]["speedup"],
        "lowest_request": lowest,
        "below_stock": [
            f"request {index}: {row['speedup']}x" for index, row in enumerate(rows) if row["speedup"] < 1.0
        ],
    }


def slower(tower: dict[str, Any]) -> list[str]:
    """Every fixed case and mix request of a tower's report below 1.00x stock, with its speed-up and route."""
    found = [
        f"{case}: {row['speedup']}x ({', '.join(row['route'])})"
        for case, row in tower.get("cases", {}).items()
        if row.get("speedup", 1.0) < 1.0
    ]
    requests = tower.get("mix", {}).get("requests", [])
    found += [
        f"mix request {index} ({row['patches']} patches): {row['speedup']}x ({', '.join(row['route'])})"
        for index, row in enumerate(requests)
        if row["speedup"] < 1.0
    ]
    return found


# -- towers ----------------------------------------------------------------------------------------------------


def _describe(tower: torch.nn.Module, served, start: float, args) -> dict[str, Any]:
    synchronize(args.device)
    return {
        "tower_class": type(tower).__name__,
        "parameters_m": round(sum(p.numel() for p in tower.parameters()) / 1e6, 1),
        "build_s": round(time.perf_counter() - start, 1),
    }


def run_packed(name: str, args, out: dict[str, Any], save: Callable[[], None]) -> None:
    """A packed tower: the fixed cases, the mix and the profile, written into ``out`` (``save()`` after each)."""
    from vgraph_compile.sample_models.vision_utils_towers import build_tower

    start = time.perf_counter()
    tower = build_tower(name, tiny=args.toy, device=args.device, dtype=args.dtype)
    options = {"compiler": "eager", **TOY_BUDGETS} if args.toy else {}
    served = compile_vision_tower(tower, max_items=MAX_ITEMS, max_frames=MAX_FRAMES, **options)
    with torch.inference_mode():
        served.warmup()
    out.update(kind="packed", **_describe(tower, served, start, args), budgets=list(served.vgraph_config.budgets))
    interface, geometry = served.interface, served.geometry
    field = interface.outputs[0].name  # pooler_output, or last_hidden_state for a tower without one
    scale = TOY_SCALE if args.toy else 1

    def grid_of(items_px) -> list[tuple[int, int, int]]:
        items = [(frames, h // scale, w // scale) for frames, h, w in items_px]
        return to_grid(items, geometry.patch_size, geometry.temporal_patch_size, geometry.spatial_merge_size)

    def calls(grid) -> tuple[Callable, Callable]:
        grid_thw = torch.tensor(grid)
        x = torch.randn(interface.pixel_values_shape(int(grid_thw.prod(-1).sum())), device=args.device)
        x, on_device = x.to(args.dtype), grid_thw.to(args.device)
        return (lambda: tower(x, on_device)), (lambda: served(x, grid_thw))

    with torch.inference_mode():  # a first call: what the runtime measures once, on its first call, happens here
        calls(grid_of(PACKED_CASES["1x224^2"]))[1]()
    out["build_s"] = _describe(tower, served, start, args)["build_s"]
    print(f"{name}: built, warmed up and called once in {out['build_s']} s", flush=True)

    def case(grid) -> dict[str, Any]:
        stock, vgraph = calls(grid)
        patches = sum(t * h * w for t, h, w in grid)
        flops = tower_flop_split(tower, grid, interface)
        return {"patches": patches, **measure(stock, vgraph, served, flops, field, args)}

    with torch.inference_mode():
        out["cases"] = {}
        for case_name, items_px in PACKED_CASES.items():
            grid = grid_of(items_px)
            if interface.video_failure and any(t > 1 for t, _, _ in grid):
                out["cases"][case_name] = {"skipped": f"images only: {interface.video_failure}"}
            else:
                out["cases"][case_name] = case(grid)
            print(f"{name} {case_name}: {_brief(out['cases'][case_name])}", flush=True)
        save()
        rows = []
        for index, items_px in enumerate(random_requests(args.seed, args.requests)):
            grid = grid_of(items_px)
            if interface.video_failure:  # its model passes a video one frame per item
                grid = [(1, h, w) for t, h, w in grid for _ in range(t)]
            rows.append({"grid": [list(item) for item in grid], **case(grid)})
            print(f"{name} mix request {index}: {_brief(rows[-1])}", flush=True)
        out["mix"] = {"seed": args.seed, "requests": rows, "total": mix_totals(rows) if rows else None}
        print(f"{name} mix total: {out['mix']['total']}", flush=True)
        save()
        if args.profile:
            typical = statistics.median_low(row["patches"] for row in rows) if rows else None
            profiled = {PROFILED_CASE: grid_of(PACKED_CASES[PROFILED_CASE])}
            if typical is not None:
                index = next(i for i, row in enumerate(rows) if row["patches"] == typical)
                profiled[f"mix request {index}"] = [tuple(item) for item in rows[index]["grid"]]
            out["profile"] = {label: profile_pair(*calls(grid), args.device) for label, grid in profiled.items()}
            print(f"{name} profile: {_profile_brief(out['profile'])}", flush=True)
    _finish(served, out)


def run_tiled(name: str, args, out: dict[str, Any], save: Callable[[], None]) -> None:
    """A fixed-tile tower at ``TILES`` tiles, and the profile at ``PROFILED_TILES``, written into ``out``."""
    start = time.perf_counter()
    tower = build_tile_tower(name, args.toy, args.dtype, args.device)
    served = compile_tile_tower(tower, **({"compiler": "eager"} if args.toy else {}))
    size = tower.config.image_size if isinstance(tower.config.image_size, int) else tower.config.image_size[0]
    inputs = {n: torch.randn(n, 3, size, size, device=args.device, dtype=args.dtype) for n in TILES}
    with torch.inference_mode():
        served(inputs[TILES[1]])  # traces, compiles once and captures every bucket
        out.update(kind="tiled", **_describe(tower, served, start, args))
        out["budgets"] = [bucket.shape.budget for runtime in served.runtimes for bucket in runtime.buckets]
        print(f"{name}: built and warmed up in {out['build_s']} s", flush=True)
        out["cases"] = {}
        for n in TILES:
            stock, vgraph = (lambda x=inputs[n]: tower(x)), (lambda x=inputs[n]: served(x))
            flops = count_flops(stock)
            out["cases"][f"N={n}"] = {"tiles": n, **measure(stock, vgraph, served, flops, "last_hidden_state", args)}
            print(f"{name} N={n}: {_brief(out['cases'][f'N={n}'])}", flush=True)
        save()
        if args.profile:
            n = PROFILED_TILES
            out["profile"] = {f"N={n}": profile_pair(lambda: tower(inputs[n]), lambda: served(inputs[n]), args.device)}
            print(f"{name} profile: {_profile_brief(out['profile'])}", flush=True)
    _finish(served, out)


def _finish(served, out: dict[str, Any]) -> None:
    out["kernels"] = {
        f"trace {index} group {group}": kernel
        for index, runtime in enumerate(served.runtimes)
        for group, kernel in sorted(runtime.encoder.kernels.items())
    }
    out["stats"] = served.stats_table()
    out["slower"] = slower(out)


def _brief(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    return (
        f"stock {row['stock_ms']} ms, vgraph {row['vgraph_ms']} ms ({row['speedup']}x), roofline {row['roofline_ms']} "
        f"ms (stock {row['stock_over_roofline']}x, vgraph {row['vgraph_over_roofline']}x), route {row['route']}, "
        f"kernels {row['kernels']}"
    )


def _profile_brief(profile: dict[str, Any]) -> str:
    return "; ".join(
        f"{label} {system} {split['attention_ms']}/{split['gemm_ms']}/{split['rest_ms']} ms"
        for label, systems in profile.items()
        for system, split in systems.items()
    )


class KernelLog(logging.Handler):
    """The messages of ``rewrite.kernel_choice`` (the kernels ``auto`` timed and kept) since the last ``take()``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        source = logging.getLogger("vgraph_compile.rewrite.kernel_choice")
        source.setLevel(logging.INFO)
        source.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken


# -- tables for BENCHMARKS.md ----------------------------------------------------------------------------------


def tables(reports: list[dict[str, Any]]) -> str:
    """The mix totals (one row per tower and install) and the fixed cases, as BENCHMARKS.md's markdown tables."""
    lines = [
        "| tower | install | stock ms | vgraph ms | roofline ms | stock / roofline | vgraph / roofline | "
        "share of stock removed | lowest vs stock | below 1.00× |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for name, tower in report["towers"].items():
            total = tower.get("mix", {}).get("total")
            if total:
                lines.append(
                    f"| {name} | {report['install']} | {total['stock_ms']:,} | {total['vgraph_ms']:,} | "
                    f"{total['roofline_ms']:,} | {total['stock_over_roofline']}× | {total['vgraph_over_roofline']}× | "
                    f"{total['share_of_stock_removed']:.0%} | {total['lowest_speedup']}× | "
                    f"{len(total['below_stock'])} |"
                )
    lines += [
        "",
        "| tower | case | install | GFLOPs (attention) | roofline ms | stock ms (/ roofline) | "
        "vgraph ms (/ roofline) | vs stock | route | kernels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for name, tower in report["towers"].items():
            for case, row in tower.get("cases", {}).items():
                if "skipped" in row:
                    lines.append(f"| {name} | {case} | {report['install']} | skipped: {row['skipped'][:80]} |||||||")
                    continue
                flops = row["flops"]
                lines.append(
                    f"| {name} | {case} | {report['install']} | {flops['total'] / 1e9:,.4g} "
                    f"({flops['attention'] / flops['total']:.0%}) | {row['roofline_ms']:.3g} | {row['stock_ms']} "
                    f"({row['stock_over_roofline']}×) | {row['vgraph_ms']} ({row['vgraph_over_roofline']}×) | "
                    f"{row['speedup']}× | {', '.join(row['route'])} | {'; '.join(row['kernels'].values())} |"
                )
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------------------


def _tower_name(name: str) -> str:
    """A ``--towers`` entry: a tile tower of ``bench.tile_towers`` or a served packed family's model type."""
    if name in TILE_TOWERS or name in PACKED:
        return name
    from vgraph_compile.sample_models.vision_utils_towers import vision_utils_families

    if name not in vision_utils_families():
        raise argparse.ArgumentTypeError(
            f"{name!r} is neither a tile tower ({', '.join(TILE_TOWERS)}) nor a transformers vision_utils family"
        )
    return name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", nargs="+", type=_tower_name, default=list(PACKED + TILED))
    parser.add_argument("--requests", type=int, default=40, help="seeded random requests of the mix (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case and system (their median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per case and system (at least 1)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the kernel profile")
    parser.add_argument(
        "--install", choices=["auto", "plain", "cuda"], default="auto",
        help="the install the run is meant to be (stops when the environment is the other); auto: whatever it is",
    )  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=420.0, help="start no tower after this many seconds")
    parser.add_argument("--add", action="store_true", help="keep the towers of the report already at the path")
    parser.add_argument("--toy", action="store_true", help="tiny towers on the CPU (fp32): checks the logic")
    parser.add_argument("--json", help="report path (default: benchmarks/results/roofline_<device>_<install>.json)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print BENCHMARKS.md's tables of these reports")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first untimed call's output is checked against stock's")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.table:
        print(tables([json.loads(pathlib.Path(path).read_text()) for path in args.table]))
        return {}
    if not args.toy and not torch.cuda.is_available():
        raise SystemExit("roofline.py times bf16 towers on a CUDA GPU and none is visible: run it there, or --toy")
    args.device = "cpu" if args.toy else "cuda"
    args.dtype = torch.float32 if args.toy else torch.bfloat16
    found = install()
    if args.install not in ("auto", found["tag"]):
        raise SystemExit(
            f"--install {args.install}: this environment is the {found['install']} install (importable: "
            f"{found['importable']}); install or remove flash-attn-4 and nvidia-cudnn-frontend, or run with "
            f"--install {found['tag']}"
        )
    device = device_record(args.device)
    default = (
        pathlib.Path(tempfile.gettempdir()) / "roofline_cpu_toy.json"
        if args.toy
        else (RESULTS / f"roofline_{device['device_tag']}_{found['tag']}.json")
    )
    path = pathlib.Path(args.json or default)
    report: dict[str, Any] = {
        "benchmark": "roofline",
        **device,
        "install": found["install"],
        "install_tag": found["tag"],
        "importable": found["importable"],
        "versions": found["versions"],
        "toy": args.toy,
        "roofline": {"attention_tflops": ATTENTION_TFLOPS, "linear_tflops": LINEAR_TFLOPS},
        "settings": {
            "seed": args.seed,
            "requests": args.requests,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "max_items": MAX_ITEMS,
            "max_frames": MAX_FRAMES,
            "dtype": str(args.dtype),
        },
        "towers": {},
        "skipped": {},
    }
    if args.add and path.exists():
        earlier = json.loads(path.read_text())
        if (earlier.get("device"), earlier.get("install_tag")) != (report["device"], report["install_tag"]):
            raise SystemExit(
                f"--add: {path} is of {earlier.get('device')} ({earlier.get('install')}), this run of "
                f"{report['device']} ({report['install']}): name another --json"
            )
        report["towers"] = {name: tower for name, tower in earlier["towers"].items() if name not in args.towers}

    def save() -> None:
        write_report(report, str(path))

    kernel_log = KernelLog()
    begin = time.perf_counter()
    for name in args.towers:
        elapsed = time.perf_counter() - begin
        if elapsed > args.deadline_s:
            report["skipped"][name] = (
                f"not started: {elapsed:.0f} s past --deadline-s {args.deadline_s:.0f}; add it with "
                f"python benchmarks/roofline.py --towers {name} --add --install {found['tag']}"
            )
            print(f"{name}: {report['skipped'][name]}", flush=True)
            continue
        torch._dynamo.reset()
        started = time.perf_counter()
        entry: dict[str, Any] = {}
        report["towers"][name] = entry
        try:
            (run_tiled if name in TILE_TOWERS else run_packed)(name, args, entry, save)
        except Exception as error:  # a tower that breaks is reported, never dropped
            traceback.print_exc()
            entry["failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            print(f"{name} failed: {entry['failed']}", flush=True)
        entry["kernel_log"] = kernel_log.take()
        entry["elapsed_s"] = round(time.perf_counter() - started, 1)
        gc.collect()  # the tower, its graphs and their pool, before the next tower is built
        if args.device == "cuda":
            torch.cuda.empty_cache()
        report["slower"] = [
            f"{tower} {line}" for tower, entry in report["towers"].items() for line in entry.get("slower", [])
        ]
        report["elapsed_s"] = round(time.perf_counter() - begin, 1)
        save()
        print(f"{name}: done in {entry['elapsed_s']} s, {report['elapsed_s']} s in all; written to {path}", flush=True)
    print(tables([report]))
    print(f"below 1.00x stock: {report.get('slower') or 'none'}; written to {path}", flush=True)
    return report


if __name__ == "__main__":
    main()
