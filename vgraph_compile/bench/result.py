"""One system's measures, and the recompiles and re-records counted after its warm-up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from vgraph_compile.bench.timing import cuda_graph_captures, dynamo_graphs

__all__ = ["Result", "AfterWarmup"]


@dataclass
class Result:
    """One system's measures; ``summary()`` is its row of the report."""

    latencies_ms: list[float] = field(default_factory=list)
    cases_ms: dict[str, float] = field(default_factory=dict)
    warmup_s: float = 0.0
    host_ms_per_call_p50: float | None = None
    """Median host time from call to return, the device idle before each call."""
    recompiles: int = 0
    """Dynamo graphs compiled after warm-up."""
    rerecords: int = 0
    """CUDA graphs recorded after warm-up."""
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
        if self.host_ms_per_call_p50 is not None:
            stats["host_ms_per_call_p50"] = round(self.host_ms_per_call_p50, 3)
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


class AfterWarmup:
    """Dynamo recompiles and CUDA graph recordings from construction to ``stop(result)``."""

    def __init__(self) -> None:
        self.graphs, self.captures = dynamo_graphs(), cuda_graph_captures()

    def stop(self, result: Result) -> None:
        result.recompiles += dynamo_graphs() - self.graphs
        result.rerecords += cuda_graph_captures() - self.captures
