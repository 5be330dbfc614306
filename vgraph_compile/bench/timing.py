"""Clocks and counts: device time of a call, host time per call, CUDA graph captures and dynamo graphs."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import torch

__all__ = [
    "synchronize",
    "elapsed_ms",
    "median_ms",
    "host_ms_per_call",
    "cuda_graph_captures",
    "dynamo_graphs",
    "check_deadline",
]


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn: Callable[[], Any], device: torch.device | str = "cuda") -> float:
    """Device time of one ``fn()``: CUDA events on CUDA, wall time around a synchronized call on the CPU."""
    if torch.device(device).type != "cuda":
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, device: torch.device | str = "cuda") -> float:
    """Median of ``repeats`` timings of ``fn`` (``elapsed_ms``), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeats))


def host_ms_per_call(fn: Callable[[], Any], calls: int = 50, device: torch.device | str = "cuda") -> float:
    """Median host wall time from call to return, the device idle before each call (synchronized, untimed)."""
    samples = []
    for _ in range(calls):
        synchronize(device)
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
    synchronize(device)
    return statistics.median(samples)


_captures = 0


@functools.cache
def _count_captures() -> None:
    original = torch.cuda.CUDAGraph.capture_begin

    @functools.wraps(original)
    def capture_begin(self, *args, **kwargs):
        global _captures
        _captures += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture_begin


def cuda_graph_captures() -> int:
    """CUDA graphs recorded in this process since the first call, whoever recorded them (inductor's graph trees,
    vgraph's build, the oracle): each goes through ``torch.cuda.CUDAGraph.capture_begin``, counted here."""
    _count_captures()
    return _captures


def dynamo_graphs() -> int:
    """Graphs dynamo compiled in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def check_deadline(deadline: float, what: str) -> None:
    """Raise ``TimeoutError(what)`` once ``time.perf_counter()`` is past ``deadline``."""
    if time.perf_counter() > deadline:
        raise TimeoutError(what)
