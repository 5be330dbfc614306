"""A tower's FLOPs per forward and the device's measured matmul rate: the MFU's numerator and denominator."""

from __future__ import annotations

import torch

from vgraph_compile.bench.timing import median_ms

__all__ = ["matmul_peak_tflops", "tower_flops"]


def matmul_peak_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10), the MFU denominator."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b, repeats=10) / 1e9


def tower_flops(tower, grid) -> float:
    """Matmul and attention FLOPs of one forward (the merger and patch embedding included)."""
    config = tower.config
    width = getattr(config, "embed_dim", None) or config.hidden_size  # Qwen2-VL's hidden_size is the merger's
    mlp = getattr(config, "intermediate_size", None) or width * getattr(config, "mlp_ratio", 4)
    gated = type(tower).__name__.startswith("Qwen2_5")
    tokens = sum(t * h * w for t, h, w in grid)
    frames = [h * w for t, h, w in grid for _ in range(t)]
    window = (config.window_size // config.patch_size) ** 2 if gated else None
    full_blocks = set(getattr(config, "fullatt_block_indexes", range(config.depth)))
    flops = 2 * tokens * width * (4 * width + (3 if gated else 2) * mlp) * config.depth
    for block in range(config.depth):
        segment = sum(f * f for f in frames) if (block in full_blocks or not gated) else tokens * window
        flops += 4 * segment * width
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    merged = tokens // config.spatial_merge_size**2
    out = getattr(config, "out_hidden_size", None) or config.hidden_size
    merge_width = width * config.spatial_merge_size**2
    return flops + 2 * tokens * patch_dim * width + 2 * merged * merge_width * (merge_width + out)
