"""The Qwen vision towers at their released sizes, or resized for tests (configs only, random weights: nothing
is downloaded)."""

from __future__ import annotations

import torch

__all__ = ["REAL_SIZES", "TOY_SIZES", "MERGER_WIDTH", "qwen_tower"]

REAL_SIZES = {
    "qwen2-vl": (
        "transformers.models.qwen2_vl.modeling_qwen2_vl",
        "Qwen2VisionTransformerPretrainedModel",
        "Qwen2VLVisionConfig",
        dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=3584),
    ),
    "qwen2.5-vl": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
        "Qwen2_5_VLVisionConfig",
        dict(
            depth=32,
            hidden_size=1280,
            num_heads=16,
            intermediate_size=3420,
            out_hidden_size=3584,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
    ),
    "qwen3-vl": (
        "transformers.models.qwen3_vl.modeling_qwen3_vl",
        "Qwen3VLVisionModel",
        "Qwen3VLVisionConfig",
        dict(
            depth=27,
            hidden_size=1152,
            num_heads=16,
            intermediate_size=4304,
            out_hidden_size=4096,
            deepstack_visual_indexes=[8, 16, 24],
            num_position_embeddings=2304,
            patch_size=16,
        ),
    ),
}
"""Vision towers of Qwen2-VL-7B, Qwen2.5-VL-7B and Qwen3-VL-8B: (module, tower class, config class, config)."""


TOY_SIZES = {
    "qwen2-vl": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2),
    "qwen2.5-vl": dict(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=48, fullatt_block_indexes=[1]
    ),
    "qwen3-vl": dict(
        depth=2,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=48,
        deepstack_visual_indexes=[0],
        num_position_embeddings=64,
    ),
}
"""The three tower families at toy sizes (2 blocks, width 32, merger output 48); the rest of each config as
released."""
MERGER_WIDTH = {"qwen2-vl": "hidden_size", "qwen2.5-vl": "out_hidden_size", "qwen3-vl": "out_hidden_size"}
"""The config field holding the merger's output width (the language model's width inside a VLM)."""


def qwen_tower(kind: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **resize):
    """The ``kind`` tower with random weights, in eval mode, using transformers' sdpa attention; ``resize``
    overrides config fields of the released size (e.g. ``depth=2, hidden_size=32`` for a test tower)."""
    import importlib

    module_name, tower_name, config_name, fields = REAL_SIZES[kind]
    module = importlib.import_module(module_name)
    torch.manual_seed(seed)
    config = getattr(module, config_name)(**{**fields, **resize})
    tower = getattr(module, tower_name)._from_config(config, attn_implementation="sdpa")
    return tower.to(device, dtype).eval()
