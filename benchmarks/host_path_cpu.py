"""Host time per call of the serving path on the CPU, the real path: a one-block Qwen2.5-VL-shaped encoder
(``WindowedViT``: patches, two cu_seqlens, two max_seqlen, a window index) compiled by inductor.

Per way in (the runtime called directly, ``vgraph_compile.encoder``'s hot path), the median over 2000 calls. The
compiled code runs once per bucket; then each bucket returns those outputs (as a replayed CUDA graph returns its
static outputs) so what is timed is the host path alone: checks, choice, fills, narrowing and copy-out. Two images
of 8x12 and 4x4 patches, ``check_values`` as configured (default on).

    python benchmarks/host_path_cpu.py [--json PATH] [--no-check-values]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import vgraph_compile
from vgraph_compile.bench.report import write_report
from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs
from vgraph_compile.sample_models.packed_vit import WindowedViT


class _ReturnOutputs:
    """Stands in for a captured graph on the CPU: the bucket returns the outputs of its one real run."""

    def replay(self) -> None:
        return None


def _median_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return round(1e6 * statistics.median(samples), 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--no-check-values", action="store_true")
    args = parser.parse_args(argv)
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
        for bucket in runtime.buckets:
            bucket.fill_empty(runtime.encoder.roles)
            bucket.outputs, bucket.graph = bucket.run(runtime.encoder.compiled), _ReturnOutputs()
        runtime_us = _median_us(lambda: runtime(*graph_inputs))
        decorator_us = _median_us(lambda: decorated(*inputs))
    report = {
        "device": "cpu",
        "torch": torch.__version__,
        "check_values": not args.no_check_values,
        "runtime_host_us": runtime_us,
        "decorator_host_us": decorator_us,
    }
    print(json.dumps(report, indent=1))
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
