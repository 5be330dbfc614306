"""Host time per call of the three ways in: the runtime called directly, ``vgraph_compile.encoder`` (the hot path
that skips dynamo), and ``torch.compile(backend="vgraph")`` (dynamo's guards on every call).

A 24-block ``PackedViT`` (294 parameters), two images. On CUDA each call is timed with the GPU idle before it (call
to return). On the CPU the buckets' compute is replaced by a no-op (the graphs' outputs from one real run are
returned as is), so what is timed is the host bookkeeping alone. Medians over 300 calls.

    python benchmarks/host_overhead.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

import vgraph_compile
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import host_ms_per_call
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.serve import fills


class _NoOpGraph:
    """Stands in for a captured graph on the CPU: the bucket returns the outputs of its one real run."""

    def replay(self) -> None:
        return None


def _host_only(runtime) -> None:
    for bucket in runtime.buckets:
        fills.empty_bucket(bucket, runtime.encoder.roles)
        bucket.outputs = bucket.run(runtime.encoder.compiled)
        bucket.graph = _NoOpGraph()


def _median_us(fn, device: torch.device) -> float:
    host_ms_per_call(fn, 30, device)  # warm-up
    return round(1e3 * host_ms_per_call(fn, 300, device), 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = PackedViT(patch_dim=48, dim=64, depth=24, heads=4, out_dim=32).to(device, dtype).eval()
    inputs = pack_images([50, 70], 48, device=device, dtype=dtype)
    options = dict(token_budgets=(128, 256), max_segments=4, check_values=False)
    if device.type == "cpu":
        options.update(compiler="eager", attention_backend="sdpa")
    decorated = vgraph_compile.encoder(model, **options)
    compiled = torch.compile(model, backend="vgraph", dynamic=True, options=options)
    with torch.inference_mode():
        decorated(*inputs)
        compiled(*inputs)
        runtimes = [decorated.vgraph.runtimes[0], vgraph_compile.runtimes()[-1]]
        if device.type == "cpu":
            for runtime in runtimes:
                _host_only(runtime)
        graph_inputs = decorated._hot.arguments.read(inputs, {})
        report = {
            "device": torch.cuda.get_device_name()
            if device.type == "cuda"
            else "cpu (bucket compute replaced by a no-op)",
            "torch": torch.__version__,
            "parameters": sum(1 for _ in model.parameters()),
            "runtime_us": _median_us(lambda: runtimes[0](*graph_inputs), device),
            "decorator_us": _median_us(lambda: decorated(*inputs), device),
            "torch_compile_us": _median_us(lambda: compiled(*inputs), device),
        }
    report["dynamo_guards_us"] = round(report["torch_compile_us"] - report["decorator_us"], 1)
    print(json.dumps(report, indent=1))
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
