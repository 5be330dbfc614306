"""The second start: the same systems' warm-up in a fresh process with the same inductor cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["second_start", "add_second_start"]


def _workload_argv(args) -> list[str]:
    """The command-line options that define the run (tower, systems, workload, compile settings)."""
    argv = ["--tower", args.tower, "--systems", *args.systems, "--cases", *args.cases, "--device", args.device]
    argv += ["--requests", str(args.requests), "--seed", str(args.seed), "--time-limit", str(args.time_limit)]
    argv += ["--compile-backend", args.compile_backend]
    for flag, pairs in (("--resize", args.resize), ("--vgraph-option", args.vgraph_option)):
        if pairs:
            argv += [flag, *(f"{key}={json.dumps(value)}" for key, value in pairs.items())]
    return argv


def second_start(args) -> dict[str, Any]:
    """The same systems' warm-up again in a fresh process with the same inductor cache directory: its report."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "second_start.json")
        command = [sys.executable, "-m", "vgraph_compile.bench.cli", *_workload_argv(args), "--warmup-only"]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": args.cache_dir}
        subprocess.run([*command, "--json", out], env=env, check=True)
        with open(out) as handle:
            return json.load(handle)


def add_second_start(report: dict[str, Any], second: dict[str, Any]) -> None:
    report["second_start_inductor_cache_dir"] = second["inductor_cache_dir"]
    for name, row in second["systems"].items():
        report["systems"][name]["second_start_warmup_s"] = row["warmup_s"]
        if row["status"] != "ok":
            report["systems"][name]["second_start_status"] = row["status"]
