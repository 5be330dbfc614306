"""Where a process's peak GPU memory went: the live allocations at the peak of a recorded allocator trace, by the
code that made them.

Reads a ``torch.cuda.memory._snapshot()`` taken with ``torch.cuda.memory._record_memory_history`` on (Python
stacks). Invariant: the bytes at the peak are the allocator trace replayed in order (``alloc`` adds a block,
``free_completed`` removes it); blocks allocated before recording started are not in the trace, so the peak is of
what was allocated while recording.
"""

from __future__ import annotations

import collections
from typing import Any

MIB = 2**20
GIB = 2**30

OWN_CODE = ("vgraph_compile/", "transformers/", "benchmarks/")
"""Frames that name where an allocation came from (the first of them, from the innermost frame out)."""


def _origin(frames: list[dict[str, Any]]) -> str:
    for frame in frames:
        filename = frame["filename"]
        for marker in OWN_CODE:
            if marker in filename:
                return f"{marker}{filename.split(marker, 1)[1]}:{frame['line']} {frame['name']}"
    return "elsewhere"


def peak_breakdown(snapshot: dict[str, Any], device: int = 0, top: int = 12) -> dict[str, Any]:
    """``{"peak_mib", "by_origin": [[where, MiB], ...]}``: the most bytes live at once over the recorded trace of
    ``device``, and the live blocks at that moment grouped by the first own-code frame of their allocation."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][device]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _origin(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_origin: collections.Counter[str] = collections.Counter()
    for size, origin in at_peak.values():
        by_origin[origin] += size
    return {
        "peak_mib": round(peak / MIB, 1),
        "by_origin": [[origin, round(size / MIB, 1)] for origin, size in by_origin.most_common(top)],
    }
