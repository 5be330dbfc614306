"""``compile_vlm(model)``: a whole transformers VLM whose vision tower is served by vgraph, in place.

The model's own code is unchanged: ``model(...)``, ``generate(...)``, ``get_image_features`` and
``get_video_features`` call the tower attribute as before (``visual``, ``vision_tower``, ``vision_model``...), and
that attribute now holds a ``CompiledVisionTower`` (same parameters, same names, same output objects). Images and
videos, in one prompt or a batch of prompts, reach the tower as one packed call per modality, which vgraph packs
into its buckets. A tower served on images only (``PackedTower.video_failure``) refuses a video call with a
``ValueError`` naming the reason: such a model's videos are passed one frame per grid row.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vgraph_compile.hf.vision_tower import CompiledVisionTower, compile_vision_tower, is_packed_tower

__all__ = ["compile_vlm", "find_vision_tower"]

log = logging.getLogger(__name__)


def find_vision_tower(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module holding the vision tower, the attribute name): the shallowest submodule of ``model`` that is a
    vision tower (a ``CompiledVisionTower``, or a model whose forward takes a grid and whose config is the model's
    ``vision_config``, when the model has one)."""
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    found = []
    for path, module in model.named_modules():
        if not path:
            continue
        is_tower = isinstance(module, CompiledVisionTower) or (
            is_packed_tower(module) and (vision_config is None or module.config is vision_config)
        )
        if is_tower:
            found.append(path)
    if not found:
        raise ValueError(
            f"compile_vlm found no vision tower in {type(model).__name__}: no submodule takes packed patch rows with "
            "a grid (grid_thw, image_grid_thw...). Compile its tower with vgraph_compile.hf.compile_vision_tower, or "
            "its encoder with vgraph_compile.encoder"
        )
    path = min(found, key=lambda name: name.count("."))
    owner_path, _, attribute = path.rpartition(".")
    return model.get_submodule(owner_path), attribute


def compile_vlm(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Replace the vision tower of ``model`` with ``compile_vision_tower(tower, **options)``; returns ``model``.

    ``options`` are ``compile_vision_tower``'s (``token_budgets``, ``max_items``, ``max_frames``,
    ``process_group`` for data-parallel encoding over the ranks that run this model, VGraphConfig fields).
    Compiling a model again recompiles its original tower with the new options.
    """
    owner, attribute = find_vision_tower(model)
    tower = getattr(owner, attribute)
    if isinstance(tower, CompiledVisionTower):
        tower = tower.tower
    setattr(owner, attribute, compile_vision_tower(tower, **options))
    log.info("%s: vision tower %s (.%s) served by vgraph", type(model).__name__, type(tower).__name__, attribute)
    return model
