"""The issue's targets: each a measure read from one merged report, a bound and a verdict."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Target", "TARGETS", "ORACLE_TARGET", "targets", "targets_table"]


def _ended_ok(report: dict[str, Any], system: str) -> bool:
    """Whether ``system`` ran to the end: a failed run's numbers (its zeros above all) prove nothing."""
    return report["systems"].get(system, {}).get("status") == "ok"


def _value(report: dict[str, Any], system: str, key: str) -> float | None:
    return report["systems"][system].get(key) if _ended_ok(report, system) else None


def _case(report: dict[str, Any], case: str, system: str) -> float | None:
    return report["cases"].get(case, {}).get(system) if _ended_ok(report, system) else None


def _of_vgraph(key: str) -> Callable[[dict[str, Any], float | None], float | None]:
    return lambda report, baseline: _value(report, "vgraph", key)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def _worst_case_vs_oracle(report: dict[str, Any], baseline: float | None) -> float | None:
    ratios = [
        _ratio(_case(report, case, "vgraph"), _case(report, case, "exact_shape_oracle")) for case in report["cases"]
    ]
    return max((ratio for ratio in ratios if ratio is not None), default=None)


@dataclass(frozen=True)
class Target:
    """A measure of the report, the bound it must meet, and how to read it."""

    measure: str
    compare: Callable[[float, float], bool]
    """``operator.le`` (at most ``bound``) or ``operator.ge`` (at least)."""
    bound: float
    value: Callable[[dict[str, Any], float | None], float | None]
    """The measured value from a (merged) report and the baseline peak GiB; None when the report lacks it."""


ORACLE_TARGET = Target("worst fixed case, vgraph / exact_shape_oracle", operator.le, 1.05, _worst_case_vs_oracle)
TARGETS = (
    Target(
        "requests p50, hf_eager_sdpa / vgraph",
        operator.ge,
        7.0,
        lambda report, baseline: _ratio(_value(report, "hf_eager_sdpa", "p50_ms"), _value(report, "vgraph", "p50_ms")),
    ),
    Target(
        "requests p50, torch_compile_routed / vgraph",
        operator.ge,
        1.5,
        lambda report, baseline: _ratio(
            _value(report, "torch_compile_routed", "p50_ms"), _value(report, "vgraph", "p50_ms")
        ),
    ),
    ORACLE_TARGET,
    Target(
        "1x224^2 ms, vgraph",
        operator.le,
        3.0,
        lambda report, baseline: _case(report, "1x224^2", "vgraph"),
    ),
    Target("host ms per call, vgraph", operator.le, 0.15, _of_vgraph("host_ms_per_call_p50")),
    Target("cold warm-up s, vgraph", operator.le, 30.0, _of_vgraph("warmup_s")),
    Target("second-process warm-up s, vgraph", operator.le, 10.0, _of_vgraph("second_start_warmup_s")),
    Target("recompiles after warm-up, vgraph", operator.le, 0, _of_vgraph("recompiles")),
    Target("re-records after warm-up, vgraph", operator.le, 0, _of_vgraph("rerecords")),
    Target(
        "peak memory, vgraph / baseline",
        operator.le,
        1.2,
        lambda report, baseline: _ratio(_value(report, "vgraph", "peak_mem_gib"), baseline),
    ),
)
"""The issue's targets, each read from one merged report."""


def targets(report: dict[str, Any], baseline_peak_gib: float | None = None) -> list[dict[str, Any]]:
    """Each target's measured value (rounded to 3 decimals) and verdict; ``pass`` is None where the report does
    not hold the measure (a system not run, or run without finishing its timed part)."""
    rows = []
    for target in TARGETS:
        value = target.value(report, baseline_peak_gib)
        sign = "<=" if target.compare is operator.le else ">="
        rows.append(
            {
                "measure": target.measure,
                "target": f"{sign} {target.bound:g}",
                "measured": None if value is None else round(value, 3),
                "pass": None if value is None else bool(target.compare(value, target.bound)),
            }
        )
    return rows


def targets_table(rows: list[dict[str, Any]]) -> str:
    verdicts = {True: "pass", False: "FAIL", None: "not measured"}
    lines = [f"{'target':>46} {'bound':>8} {'measured':>9}  verdict"]
    for row in rows:
        measured = "-" if row["measured"] is None else f"{row['measured']:g}"
        lines.append(f"{row['measure']:>46} {row['target']:>8} {measured:>9}  {verdicts[row['pass']]}")
    return "\n".join(lines)
