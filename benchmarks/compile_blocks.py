"""Inductor's compile of a many-block encoder with its blocks inline and with each class of identical blocks compiled
once (``compile_blocks_once``), each in a fresh process on a fresh inductor cache; and whether the two give the
same outputs.

Encoders: ``PackedViT`` and ``WindowedViT`` (window blocks, and full-attention blocks every fourth), fp32, random
weights. Per encoder and mode: ``compile_once``'s wall seconds (inductor's compile), the first call's, and the
largest difference from eager; then the largest difference between the two modes' outputs.

    python benchmarks/compile_blocks.py [--depth 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from vgraph_compile.bench.report import write_report


def _encoder(kind: str, depth: int):
    from vgraph_compile.sample_models import explain_factories
    from vgraph_compile.sample_models.packed_vit import PackedViT, WindowedViT, pack_images

    torch.manual_seed(0)
    if kind == "packed":
        model = PackedViT(patch_dim=12, dim=64, depth=depth, heads=4, out_dim=32).eval()
        return model, pack_images([40, 70, 30], 12), {"token_budgets": (64, 256), "max_segments": 4}
    full = tuple(range(3, depth, 4))
    model = WindowedViT(patch_dim=12, dim=64, depth=depth, heads=4, out_dim=32, full_attention_blocks=full).eval()
    inputs = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, [(1, 8, 12), (1, 4, 4)], 12)
    options = {"token_budgets": (64, 256), "geometry": explain_factories.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6}
    return model, inputs, options


def one(kind: str, depth: int, blocks: bool, out_path: str) -> dict:
    import vgraph_compile
    import vgraph_compile.compile.assemble as build
    from vgraph_compile.counters import counters

    seconds = {}
    compile_once = build.compile_once

    def timed(gm, ctx):
        start = time.perf_counter()
        try:
            return compile_once(gm, ctx)
        finally:
            seconds["compile_s"] = round(time.perf_counter() - start, 2)

    build.compile_once = timed
    model, inputs, options = _encoder(kind, depth)
    compiled = vgraph_compile.encoder(
        model, attention_backend="sdpa", artifact_dir="", compile_blocks_once=blocks, **options
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = compiled(*inputs)
        seconds["first_call_s"] = round(time.perf_counter() - start, 2)
        reference = model(*inputs)
    torch.save(out, out_path)
    return {
        **seconds,
        "max_abs_diff_vs_eager": (out - reference).abs().max().item(),
        "finite": bool(out.isfinite().all()),
        "blocks_compiled_once": counters.blocks_compiled_once,
        "replays": counters.replays,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        kind, blocks, out_path = args.one
        print(json.dumps(one(kind, args.depth, blocks == "blocks", out_path)))
        return {}
    report = {"torch": torch.__version__, "depth": args.depth, "encoders": {}}
    for kind in ("packed", "windowed"):
        runs, outputs = {}, {}
        for mode in ("inline", "blocks"):
            with tempfile.TemporaryDirectory() as cache:
                outputs[mode] = f"{cache}.out.pt"
                command = [sys.executable, __file__, "--depth", str(args.depth), "--one", kind, mode, outputs[mode]]
                environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                child = subprocess.run(command, capture_output=True, text=True, env=environment)
                if child.returncode != 0:
                    raise SystemExit(f"{kind} {mode} failed:\n{child.stderr[-4000:]}")
                runs[mode] = json.loads(child.stdout.strip().splitlines()[-1])
        difference = (torch.load(outputs["inline"]) - torch.load(outputs["blocks"])).abs().max().item()
        for path in outputs.values():
            os.remove(path)
        report["encoders"][kind] = {**runs, "max_abs_diff_inline_vs_blocks": difference}
        print(json.dumps({kind: report["encoders"][kind]}), flush=True)
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
