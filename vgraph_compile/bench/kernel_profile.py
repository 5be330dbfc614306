"""Where a call's device time goes: its kernels under the torch profiler, grouped by kind (collectives, attention,
matmuls, inductor's fused kernels). Kernels replayed from a captured CUDA graph are traced like launched ones. On the
CPU (benchmarks' toy runs) the aten ops' own CPU time stands for the kernels'."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["KINDS", "kernel_breakdown", "kind_of"]

KINDS = {
    "all-to-all (nccl)": ("sendrecv", "alltoall"),
    "all-gather (nccl)": ("allgather",),
    "other collectives (nccl)": ("nccl",),
    "attention": ("flash", "fmha", "attn", "sdpa", "cudnn"),
    "gemm": ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "_mm_", "aten::mm", "aten::addmm", "aten::bmm"),
    "triton (inductor fused)": ("triton",),
}
"""Kernel kinds, by substrings of the lowered kernel name; the first match wins (NCCL's kernels before the rest),
anything else is ``other``. The ``aten::`` names are the CPU's matmul ops."""


def kind_of(kernel: str) -> str:
    lowered = kernel.lower()
    return next((kind for kind, marks in KINDS.items() if any(mark in lowered for mark in marks)), "other")


def kernel_breakdown(fn: Callable[[], object], calls: int = 1, top: int = 15, device: str = "cuda") -> dict:
    """``calls`` calls of ``fn`` under the profiler (CUDA kernels only; on a CPU ``device``, the aten ops' own CPU
    time): device ms per call in total, and per kind its ms and launches per call, and the ``top`` kernels by
    device time (ms per call, its kind, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        else:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        if us > 0:
            kernels.append((event.key, us / 1e3 / calls, event.count / calls))
    kernels.sort(key=lambda kernel: -kernel[1])
    kinds: dict[str, float] = {}
    launches: dict[str, float] = {}
    for name, ms, count in kernels:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
        launches[kind_of(name)] = launches.get(kind_of(name), 0.0) + count
    return {
        "device_ms_total": round(sum(ms for _, ms, _ in kernels), 3),
        "by_kind_ms": {kind: round(ms, 3) for kind, ms in sorted(kinds.items(), key=lambda item: -item[1])},
        "by_kind_calls": launches,
        "top": [
            {"kernel": name[:160], "kind": kind_of(name), "ms": round(ms, 3), "calls": count}
            for name, ms, count in kernels[:top]
        ],
    }
