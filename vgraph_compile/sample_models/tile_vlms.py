"""A fixed-tile VLM for end-to-end runs: InternVL3-1B (InternViT-300M 448 px + Qwen2.5-0.5B) at its released
sizes or tiny, random weights, and its inputs made by InternVL's own image processor (``GotOcr2ImageProcessorPil``:
each image cut into up to 12 tiles of 448 px, plus a thumbnail when it has more than one).

Prompt layout, as InternVL's processor lays it out: per image, text, then ``image_seq_length`` image tokens per
tile (256 at 448 px: 1,024 patches, pixel-shuffled by 0.5); text after the last image. Text ids are random.
"""

from __future__ import annotations

import random

import torch

from vgraph_compile.sample_models.qwen_vlms import Request, resized

__all__ = ["internvl", "tile_processor", "tile_inputs", "tokens_per_tile"]

TEXT_0_5B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151674, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
)  # fmt: skip
"""Qwen2.5-0.5B, InternVL3-1B's language model."""
TINY = dict(
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=512),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                image_size=[64, 64], patch_size=[16, 16]),
    ids=dict(image_token_id=500),
)  # fmt: skip
"""Tiny: 64 px tiles of 16 patches (4 image tokens each), a vocabulary of 512."""


def internvl(tiny: bool = True, device="cpu", dtype=torch.float32, seed: int = 0):
    """``InternVLForConditionalGeneration`` with random weights in eval mode, sdpa attention."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.InternVLConfig(
        text_config={"model_type": "qwen2", **(TINY["text"] if tiny else TEXT_0_5B)},
        vision_config=TINY["vision"] if tiny else {},
        **(TINY["ids"] if tiny else {}),
    )
    with torch.device(device):
        model = transformers.InternVLForConditionalGeneration._from_config(
            config, attn_implementation="sdpa", dtype=dtype
        )
    model.generation_config.pad_token_id = 0
    return model.eval()


def tile_processor(model, max_tiles: int = 12):
    """InternVL's image processor (PIL backend) at the tower's tile size."""
    from transformers import GotOcr2ImageProcessorPil

    height, width = model.config.vision_config.image_size
    return GotOcr2ImageProcessorPil(
        crop_to_patches=True, max_patches=max_tiles, size={"height": height, "width": width}
    )


def tokens_per_tile(config) -> int:
    """Image tokens per tile: the tile's patches, pixel-shuffled by the config's downsample ratio."""
    patches = (config.vision_config.image_size[0] // config.vision_config.patch_size[0]) ** 2
    return int(patches * config.downsample_ratio**2)


def tile_inputs(model, request: Request, processor, device=None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for one request of images (``Item`` kind "image"): tiles from ``processor``,
    image tokens per tile, the request's text token counts around them."""
    images = [resized(item.pixels, item.resize_to) for item in request.items if item.kind == "image"]
    out = processor(images=images, return_tensors="pt")
    tiles = out["num_patches"].tolist()
    rng = random.Random(request.seed)
    config = model.config
    vocab = min(config.text_config.vocab_size, 1000)
    per_tile = tokens_per_tile(config)
    ids: list[int] = []
    for count, image_tiles in zip(request.text_tokens, [*tiles, 0]):
        ids += [rng.randrange(1, vocab) for _ in range(count)] + [config.image_token_id] * (per_tile * image_tiles)
    inputs = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.int64),
        "pixel_values": out["pixel_values"].to(model.dtype),
    }
    return {key: value.to(device or model.device) for key, value in inputs.items()}
