"""The fixed-tile towers the benchmarks time, at their released sizes (random weights), or tiny for the CPU."""

from __future__ import annotations

import torch

__all__ = ["TILE_TOWERS", "build_tile_tower"]

TILE_TOWERS = {
    "idefics3-384": ("Idefics3VisionConfig", "Idefics3VisionTransformer", dict(image_size=384, patch_size=14)),
    "so400m-384": ("SiglipVisionConfig", "SiglipVisionModel", dict(image_size=384, patch_size=14)),
    "internvit-448": ("InternVLVisionConfig", "InternVLVisionModel", dict(image_size=[448, 448], patch_size=[14, 14])),
    "gemma3-896": (
        "SiglipVisionConfig", "SiglipVisionModel", dict(image_size=896, patch_size=14, vision_use_head=False)
    ),
}
"""Tower name -> (config class, model class, what differs from So400m / InternViT-300M's released sizes).
``so400m-384`` is ``SiglipVisionModel`` with its default MAP head (``nn.MultiheadAttention`` pooling);
``idefics3-384`` the same encoder as Idefics3 builds it (no head); ``gemma3-896`` SigLIP at 896 px (no head)."""
SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16)
INTERNVIT_300M = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
TOY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def build_tile_tower(name: str, toy: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The tower ``name`` of ``TILE_TOWERS`` (sdpa attention, seed 0, eval mode); ``toy``: 32 px tiles of 8 px
    patches, width 32, two blocks."""
    import transformers

    config_class, model_class, sizes = TILE_TOWERS[name]
    released = INTERNVIT_300M if name.startswith("internvit") else SO400M
    if toy:
        pair = isinstance(sizes["image_size"], list)
        sizes = {**sizes, "image_size": [32, 32] if pair else 32, "patch_size": [8, 8] if pair else 8}
    config = getattr(transformers, config_class)(**(TOY if toy else released), **sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).to(device=device, dtype=dtype).eval()
