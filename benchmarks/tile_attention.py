"""Where a fixed-tile tower's time goes at large N: SDPA's attention kernels on dense equal-length tiles, and the
stock tower with each kernel forced (released sizes, random weights, bf16, CUDA).

Per tower shape (tokens a tile, heads, head dim) and N: each SDPA backend (``flash``, ``efficient``, ``cudnn``)
on ``[N, heads, tokens, head_dim]`` without a mask, and ``efficient`` with the all-True boolean
``[N, 1, tokens, tokens]`` mask a traced Idefics3 tower builds (under tracing transformers keeps the mask it skips
in eager); its median time, TFLOP/s, and relative error against a float32 math reference at N=1. Then the whole
stock tower at N=13 under each backend (``torch.nn.attention.sdpa_kernel``), beside the default choice.

    python benchmarks/tile_attention.py [--json PATH]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import median_ms

SHAPES = {"idefics3-384": (729, 16, 72), "internvit-448": (1025, 16, 64), "gemma3-896": (4096, 16, 72)}
"""Tower -> (tokens a tile, heads, head dim), as ``bench.tile_towers`` builds them."""
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
TILES = (1, 13)


def _attention(q, k, v, backend: SDPBackend, mask=None) -> torch.Tensor:
    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def kernel_rows(repeats: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, (tokens, heads, dim) in SHAPES.items():
        for n in TILES:
            q, k, v = (torch.randn(n, heads, tokens, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            reference = torch.nn.functional.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float())
            mask = torch.ones(n, 1, tokens, tokens, device="cuda", dtype=torch.bool)
            flops = 4 * n * heads * tokens * tokens * dim
            cases = {label: (backend, None) for label, backend in BACKENDS.items()}
            cases["efficient_bool_mask"] = (SDPBackend.EFFICIENT_ATTENTION, mask)
            for label, (backend, attn_mask) in cases.items():
                key = f"{name} N={n} {label}"
                try:
                    out = _attention(q, k, v, backend, attn_mask)
                    ms = median_ms(lambda: _attention(q, k, v, backend, attn_mask), repeats=repeats, warmup=3)
                except RuntimeError as refused:
                    rows[key] = {"error": str(refused).splitlines()[0][:200]}
                    print(key, rows[key], flush=True)
                    continue
                error = ((out[:1].float() - reference).norm() / reference.norm()).item()
                rows[key] = {"median_ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_err": round(error, 5)}
                print(key, rows[key], flush=True)
    return rows


def tower_rows(repeats: int) -> dict[str, Any]:
    from vgraph_compile.bench.tile_towers import build_tile_tower

    rows: dict[str, Any] = {}
    for name in SHAPES:
        tower = build_tile_tower(name, False, torch.bfloat16, "cuda")
        size = tower.config.image_size if isinstance(tower.config.image_size, int) else tower.config.image_size[0]
        pixels = torch.randn(13, 3, size, size, device="cuda", dtype=torch.bfloat16)
        choices = {"default": None, **BACKENDS}
        with torch.inference_mode():
            for label, backend in choices.items():
                key = f"{name} N=13 tower {label}"
                try:
                    if backend is None:
                        ms = median_ms(lambda: tower(pixels), repeats=repeats, warmup=2)
                    else:
                        with sdpa_kernel([backend]):
                            ms = median_ms(lambda: tower(pixels), repeats=repeats, warmup=2)
                except RuntimeError as refused:
                    rows[key] = {"error": str(refused).splitlines()[0][:200]}
                else:
                    rows[key] = {"median_ms": round(ms, 3)}
                print(key, rows[key], flush=True)
        del tower
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/tile_attention_h200.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tile_attention.py times CUDA kernels and no GPU is visible")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "kernels": kernel_rows(args.repeats),
        "towers": tower_rows(args.repeats),
    }
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
