"""Whole VLMs of the ``vision_utils`` families (``hf_families``), built from each family's own config class with
random weights, and their inputs made by each family's own image processor (its PIL backend, registered in
transformers' ``AutoImageProcessor`` table: no torchvision needed).

A family's model is the first ``*ForConditionalGeneration`` class of its modeling module; its config class is the
one that model declares. ``tiny`` shrinks every sub-config: the vision config (and any other, e.g. audio) by
``vision_utils_towers.TINY_SIZES``, the text config by ``TINY_TEXT``; a sub-config field equal to the released text width
(an adapter's or merger's output, ``out_hidden_size``) follows the tiny text width, since it feeds the language
model. A text config whose rope parameters are empty gets the default rope for each of its layer types.

Prompts are laid out as the families' processors lay them out for images: per image, text then one image token per
merged token (``t*h*w / merge^2``); ``mm_token_type_ids`` marks them where the model takes it. The text ids are
random (the vocabulary is random anyway).
"""

from __future__ import annotations

import importlib
import inspect
import random

import numpy as np
import torch

from vgraph_compile.sample_models.vision_utils_towers import TINY_SIZES, declared_config, family, shrunk

__all__ = ["RELEASED_TEXT_FIELDS", "TINY_TEXT", "build_vlm", "image_processor", "image_inputs"]

TINY_TEXT = dict(
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    moe_intermediate_size=32,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
)
"""Text config fields shrunk (where the config has them, with the same type): one layer, width 128 in one head of
128 (every family's multimodal rotary sections fit it), 4 experts with 2 routed per token."""


RELEASED_TEXT_FIELDS = {
    "glm4v": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
}
"""Text config fields a family's released checkpoints set and its config class leaves out, by model type:
GLM-4.1V rotates half of each head (its model's default rotary sections, [8, 12, 12], span 64 of 128 dims)."""


def vlm_class(name: str) -> type:
    """The family's ``*ForConditionalGeneration`` class (the first one its modeling module defines)."""
    module = importlib.import_module(family(name).tower_class.__module__)
    found = [
        value
        for value in vars(module).values()
        if inspect.isclass(value) and value.__module__ == module.__name__
        and value.__name__.endswith("ForConditionalGeneration")
    ]
    if not found:
        raise ValueError(f"{name} has no *ForConditionalGeneration class in {module.__name__}")
    return min(found, key=lambda value: inspect.getsourcelines(value)[1])


def _tiny_config(config_class: type) -> dict:
    defaults = config_class().to_dict()
    text_defaults = defaults["text_config"]
    text = shrunk(text_defaults, TINY_TEXT)
    if text_defaults.get("rope_parameters") == {} and text_defaults.get("layer_types"):
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        kinds = set(text.get("layer_types", text_defaults["layer_types"]))
        text["rope_parameters"] = {kind: dict(rope) for kind in kinds}
    fields = {"text_config": {**text_defaults, **text}}
    for key, sub in defaults.items():
        if key == "text_config" or not (key.endswith("_config") and isinstance(sub, dict)):
            continue
        tiny = shrunk(sub, TINY_SIZES)
        tiny.update({
            field: text["hidden_size"]
            for field, value in sub.items()
            if field == "out_hidden_size" or (type(value) is int and value == text_defaults["hidden_size"])
        })
        fields[key] = {**sub, **tiny}
    return fields


def build_vlm(
    name: str,
    tiny: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    text_fields: dict | None = None,
):
    """The family's VLM with random weights, in eval mode, sdpa attention: tiny (see the module docstring), or the
    config class's defaults (the released sizes); ``text_fields`` over the text config's (default: the family's
    ``RELEASED_TEXT_FIELDS``)."""
    model_class = vlm_class(name)
    config_class = declared_config(model_class)
    torch.manual_seed(seed)
    fields = _tiny_config(config_class) if tiny else {}
    text_fields = RELEASED_TEXT_FIELDS.get(name) if text_fields is None else text_fields
    if text_fields:
        fields["text_config"] = {**fields.get("text_config", config_class().to_dict()["text_config"]), **text_fields}
    config = config_class(**fields)
    with torch.device(device):
        model = model_class._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def image_processor(name: str, model, max_patches: int | None = None):
    """The family's own image processor (PIL backend) with the model's patch, temporal patch and merge sizes;
    ``max_patches`` caps each image's patches (default: the processor's own cap)."""
    from transformers.models.auto import image_processing_auto

    from vgraph_compile.hf.interface.packed_tower import config_geometry

    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES.get(name) or {}
    if "pil" not in names:
        raise ValueError(f"{name} registers no PIL image processor (only {sorted(names)}): it needs torchvision")
    processor_class = image_processing_auto.get_image_processor_class_from_name(names["pil"])
    geometry = config_geometry(model.config.vision_config)
    sizes = dict(
        patch_size=geometry.patch_size,
        temporal_patch_size=geometry.temporal_patch_size,
        merge_size=geometry.spatial_merge_size,
    )
    options = {key: value for key, value in sizes.items() if hasattr(processor_class, key)}
    if max_patches is not None:
        patch, merge = geometry.patch_size, geometry.spatial_merge_size
        options["size"] = {"shortest_edge": (patch * merge) ** 2, "longest_edge": max_patches * patch * patch}
    return processor_class(**options)


def image_inputs(model, processor, images: list[np.ndarray], text_tokens: int = 5, seed: int = 0) -> dict:
    """One prompt holding ``images`` (``[H, W, 3]`` uint8), each after ``text_tokens`` random text ids, and text
    after the last: the model's keyword inputs, pixels from ``processor``."""
    config = model.config
    pixels = processor(images=images, return_tensors="pt")
    merge = processor.merge_size
    rng = random.Random(seed)
    vocab = min(config.get_text_config().vocab_size, 1000)
    ids: list[int] = []
    kinds: list[int] = []
    for count in (pixels["image_grid_thw"].prod(-1) // merge**2).tolist() + [0]:
        ids += [rng.randrange(vocab) for _ in range(text_tokens)] + [config.image_token_id] * count
        kinds += [0] * text_tokens + [1] * count
    inputs = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.int64),
        "pixel_values": pixels["pixel_values"].to(model.dtype),
        "image_grid_thw": pixels["image_grid_thw"],
    }
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = torch.tensor([kinds])
    return {key: value.to(model.device) for key, value in inputs.items()}
