"""``compile_vlm(model)``: a whole Qwen VLM whose vision tower is served by vgraph, in place.

The model's own code is unchanged: ``model(...)``, ``generate(...)``, ``get_image_features`` and
``get_video_features`` call ``self.visual`` as before, and that attribute now holds a ``CompiledVisionTower``
(same parameters, same names, same output objects). Images and videos, in one prompt or a batch of prompts, reach
the tower as one packed call per modality, which vgraph packs into its buckets.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vgraph_compile.hf.vision_tower import CompiledVisionTower, compile_vision_tower

__all__ = ["VLM_CLASSES", "compile_vlm"]

log = logging.getLogger(__name__)

VLM_CLASSES = tuple(
    f"{family}{suffix}"
    for family in ("Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3VLMoe")
    for suffix in ("ForConditionalGeneration", "Model")
)
"""The models whose tower ``compile_vlm`` finds: ``model.model.visual`` or, for the ``*Model`` classes,
``model.visual``."""


def compile_vlm(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Replace the vision tower of ``model`` with ``compile_vision_tower(tower, **options)``; returns ``model``.

    ``options`` are ``compile_vision_tower``'s (``token_budgets``, ``max_items``, ``max_frames``,
    ``process_group`` for data-parallel encoding over the ranks that run this model, VGraphConfig fields).
    Compiling a model again recompiles its original tower with the new options.
    """
    name = type(model).__name__
    if name not in VLM_CLASSES:
        raise ValueError(
            f"compile_vlm got a {name}; it knows {', '.join(VLM_CLASSES)}. For another model, compile its vision "
            "tower with vgraph_compile.hf.compile_vision_tower, or its encoder with vgraph_compile.encoder"
        )
    owner = model.model if name.endswith("ForConditionalGeneration") else model
    tower = owner.visual
    if isinstance(tower, CompiledVisionTower):
        tower = tower.tower
    owner.visual = compile_vision_tower(tower, **options)
    log.info("%s: vision tower %s served by vgraph", name, type(tower).__name__)
    return model
