"""Reports: merged from several runs, printed as a table, written as JSON, plotted."""

from __future__ import annotations

import json
from typing import Any

from vgraph_compile.bench.targets import ORACLE_TARGET

__all__ = ["merge", "table", "write_report", "plot"]


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
    """The report as a printable table: one row per system, then the fixed cases."""
    lines = [f"{report['device']}, torch {report['torch']}, {report['model']}"]
    lines.append(
        f"{'system':>30} {'p50':>8} {'p99':>8} {'mean':>8} {'host ms':>8} {'warmup s':>9} {'recomp':>7} "
        f"{'rerec':>6} {'mem GiB':>8}  status"
    )
    for name, row in report["systems"].items():
        cells = ("p50_ms", "p99_ms", "mean_ms", "host_ms_per_call_p50")
        lines.append(
            f"{name:>30} "
            + " ".join(f"{row.get(cell, '-'):>8}" for cell in cells)
            + f" {row.get('warmup_s', '-'):>9} {row.get('recompiles', '-'):>7} {row.get('rerecords', '-'):>6} "
            f"{row.get('peak_mem_gib', '-'):>8}  {row.get('status', '-')}"
        )
    systems = list(report["systems"])
    lines.append("\n" + f"{'case ms':>16} " + " ".join(f"{name[:14]:>14}" for name in systems))
    for case, row in report["cases"].items():
        lines.append(f"{case:>16} " + " ".join(f"{row.get(name, '-'):>14}" for name in systems))
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | None) -> None:
    """Write ``report`` as JSON to ``path`` (nothing when no path was asked for); every benchmark script's output."""
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def plot(report: dict[str, Any], path: str) -> None:
    """Fixed-case times per system (log scale) and vgraph / oracle per case, as a PNG at ``path``."""
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
    right.axhline(ORACLE_TARGET.bound, color="red", linestyle="--", label=f"{ORACLE_TARGET.bound}x target")
    right.set_ylabel("vgraph / exact-shape oracle")
    right.tick_params(axis="x", rotation=15)
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
