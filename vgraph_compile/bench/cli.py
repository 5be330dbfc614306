"""``vgraph-bench``'s command line: the systems (listed in the package docstring, ``vgraph_compile.bench``) on one
Qwen tower, one process.

    vgraph-bench [--tower qwen2.5-vl] [--systems vgraph hf_eager_sdpa ...] [--json PATH] [--plot PATH]
    vgraph-bench --second-start --cache-dir DIR ...  # then the same run, warm-up only, in a fresh process
    vgraph-bench --merge a.json b.json --json all.json --targets --baseline-peak-gib 1.89  # no GPU needed
    vgraph-bench --device cpu --resize depth=1 ...    # the harness on the CPU (timings not comparable)"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch

from vgraph_compile.bench.harness import run
from vgraph_compile.bench.report import merge, plot, table, write_report
from vgraph_compile.bench.second_start import add_second_start, second_start
from vgraph_compile.bench.systems import SYSTEMS
from vgraph_compile.bench.targets import targets, targets_table
from vgraph_compile.bench.workload import CASES_PX

__all__ = ["main", "parse_args"]


def _key_value(pair: str) -> tuple[str, Any]:
    key, sep, text = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. depth=1, token_budgets=[1024,4096]), got {pair!r}")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vgraph-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tower", default="qwen2.5-vl", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--cases", nargs="+", default=list(CASES_PX), choices=list(CASES_PX))
    parser.add_argument("--requests", type=int, default=64, help="seeded random requests (at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per fixed case (median)")
    parser.add_argument("--host-calls", type=int, default=50, help="calls of the smallest case for host time")
    parser.add_argument("--time-limit", type=float, default=240.0, help="wall seconds per system")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--resize", nargs="+", type=_key_value, default=[], metavar="KEY=VALUE", help="tower config overrides"
    )
    parser.add_argument(
        "--vgraph-option",
        nargs="+",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="compile_vision_tower options for the vgraph systems (default: the library's defaults)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="backend of torch_compile_routed, torch_compile_dynamic and exact_shape_oracle",
    )
    parser.add_argument("--warmup-only", action="store_true", help="measure each system's warm-up only")
    parser.add_argument(
        "--second-start",
        action="store_true",
        help="then run the same systems' warm-up in a fresh process with the same inductor cache directory",
    )
    parser.add_argument(
        "--cache-dir", help="TORCHINDUCTOR_CACHE_DIR for this run (with --second-start: default a fresh one)"
    )
    parser.add_argument("--targets", action="store_true", help="print the targets table and store it in the JSON")
    parser.add_argument("--baseline-peak-gib", type=float, help="peak memory the vgraph target compares against")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--merge", nargs="+", help="combine these JSON reports instead of running")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    args.resize, args.vgraph_option = dict(args.resize), dict(args.vgraph_option)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``vgraph-bench``: run (or merge), print the table and the targets, write the JSON and the plot."""
    args = parse_args(argv)
    if args.merge:
        report = merge(args.merge)
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(
                "vgraph-bench times CUDA graphs and no CUDA GPU is visible: run it on a machine with one "
                "(--device cpu runs the harness on the CPU, e.g. with --resize depth=1; timings not comparable)"
            )
        if args.second_start and args.cache_dir is None:
            args.cache_dir = tempfile.mkdtemp(prefix="vgraph-bench-inductor-")
        if args.cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(args.cache_dir)
            args.cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        report = run(args)
        if args.second_start:
            add_second_start(report, second_start(args))
    print(table(report))
    if args.targets:
        report["targets"] = targets(report, args.baseline_peak_gib)
        print(targets_table(report["targets"]))
    write_report(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
