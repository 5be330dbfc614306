"""Host time per call of the serving path on the CPU, the real path, each bucket's compute replaced by its outputs.

Two encoders: a one-block Qwen2.5-VL-shaped ``WindowedViT`` (patches, two cu_seqlens, two max_seqlen, a window
index) compiled by inductor, called through the runtime directly and through ``vgraph_compile.encoder``'s hot
path (two images of 8x12 and 4x4 patches, ``check_values`` as configured, default on); and a toy Qwen2.5-VL tower
(``compile_vision_tower``, default budgets 256 .. 16384) called as a model calls it, ``tower(pixels, grid_thw)``,
on the cases of the host-time goals: 1x224^2, 4x336^2, 1x1344^2, 1x1792^2 and a 448x672 image with an 8-frame
336^2 video (the released geometry: patch 14, merge 2, windows of 112 px). The tower's pixel rows are 8 values wide
(one channel, 2x2 patches, the grid in patches as released): a CPU copies rows at memory speed inside the call, a
GPU queues them, so narrow rows keep the data's share of a CPU call small.

The compiled code runs once per bucket; then each bucket returns those outputs (as a replayed CUDA graph returns
its static outputs), so what is timed is the host path alone: checks, choice, fills, narrowing and copy-out. Medians
over 2000 calls (``--calls``).

    python benchmarks/host_path_cpu.py [--json PATH] [--no-check-values] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import vgraph_compile
from vgraph_compile.bench.report import write_report
from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs
from vgraph_compile.sample_models.packed_vit import WindowedViT
from vgraph_compile.serve import fills

TOWER_CASES = {
    "1x224^2": [(1, 16, 16)],
    "4x336^2": [(1, 24, 24)] * 4,
    "1x1344^2": [(1, 96, 96)],
    "1x1792^2": [(1, 128, 128)],
    "448x672 + video 8f 336^2": [(1, 32, 48), (4, 24, 24)],
}
"""Grids (t, h, w) in patches of 14 px, two frames per temporal patch, as the Qwen2.5-VL processor makes them."""


class _ReturnOutputs:
    """Stands in for a captured graph on the CPU: the bucket returns the outputs of its one real run."""

    def replay(self) -> None:
        return None


def _host_only(runtime) -> None:
    """Every bucket of ``runtime`` returns the outputs of one run of its compiled code from now on."""
    for bucket in runtime.buckets:
        fills.empty_bucket(bucket, runtime.encoder.roles)
        bucket.outputs, bucket.graph = bucket.run(runtime.encoder.compiled), _ReturnOutputs()


def _median_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return round(1e6 * statistics.median(samples), 1)


def _tower_cases_us(calls: int) -> dict[str, float]:
    """Host µs per call of the toy Qwen2.5-VL tower on each of ``TOWER_CASES``."""
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    model = qwen_tower(
        "qwen2.5-vl", device="cpu", dtype=torch.float32, **TOY_SIZES["qwen2.5-vl"], in_channels=1, patch_size=2,
        window_size=16,
    )  # fmt: skip
    tower = compile_vision_tower(model, max_items=8, max_frames=16, compiler="eager")
    width = model.config.in_channels * model.config.temporal_patch_size * model.config.patch_size**2
    cases = {}
    with torch.inference_mode():
        tower.warmup()
        (runtime,) = tower.runtimes
        _host_only(runtime)
        for case, grid in TOWER_CASES.items():
            grid_thw = torch.tensor(grid)
            pixels = torch.randn(int(grid_thw.prod(-1).sum()), width)
            cases[case] = _median_us(lambda: tower(pixels, grid_thw), calls)
    return cases


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--no-check-values", action="store_true")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a copy split over busy cores waits on the slowest: one thread, steadier medians
    torch.manual_seed(0)
    model = WindowedViT(patch_dim=24, dim=32, depth=1, heads=2, out_dim=16).eval()
    inputs = windowed_inputs(QWEN25_GEOMETRY, [(1, 8, 12), (1, 4, 4)], 24)
    decorated = vgraph_compile.encoder(
        model, geometry=QWEN25_GEOMETRY, token_budgets=(256, 1024), max_items=4, check_values=not args.no_check_values
    )
    with torch.inference_mode():
        decorated(*inputs)
        runtime = decorated.vgraph.runtimes[0]
        graph_inputs = decorated._hot.arguments.read(inputs, {})
        _host_only(runtime)
        runtime_us = _median_us(lambda: runtime(*graph_inputs), args.calls)
        decorator_us = _median_us(lambda: decorated(*inputs), args.calls)
    report = {
        "device": f"cpu ({os.cpu_count()} cores, one torch thread, {platform.machine()})",
        "torch": torch.__version__,
        "check_values": not args.no_check_values,
        "runtime_host_us": runtime_us,
        "decorator_host_us": decorator_us,
        "tower_host_us": _tower_cases_us(args.calls),
    }
    print(json.dumps(report, indent=1))
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
