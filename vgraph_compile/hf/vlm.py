"""The one way in for Hugging Face towers: ``compile_vision_tower(tower)`` serves a packed tower (its forward takes a
grid: ``hf/vision_tower``) or a fixed-tile tower (``forward(pixel_values[N, C, H, W])`` of one image size:
``hf/tiles``), and ``compile_vlm(model)`` finds the vision tower of a whole transformers VLM and serves it in place.

The model's own code is unchanged: ``model(...)``, ``generate(...)``, ``get_image_features`` and
``get_video_features`` call the tower attribute as before (``visual``, ``vision_tower``, ``vision_model``...), and
that attribute now holds a ``CompiledVisionTower`` or ``CompiledTileTower`` (same parameters, same names, same output
objects). Images and
videos, in one prompt or a batch of prompts, reach the tower as one packed call per modality, which vgraph packs
into its buckets. A tower served on images only (``PackedTower.video_failure``) refuses a video call with a
``ValueError`` naming the reason: such a model's videos are passed one frame per grid row.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vgraph_compile.hf.tiles import CompiledTileTower, compile_tile_tower, is_tile_tower
from vgraph_compile.hf.vision_tower import CompiledVisionTower, compile_packed_tower, is_packed_tower

__all__ = ["compile_vision_tower", "compile_vlm", "find_vision_tower"]

log = logging.getLogger(__name__)


CompiledTower = CompiledVisionTower | CompiledTileTower


def compile_vision_tower(tower: torch.nn.Module, **options: Any) -> CompiledTower:
    """Serve ``tower`` from vgraph's bucket graphs: ``compile_packed_tower`` when its forward takes a grid of packed
    variable-size images, ``compile_tile_tower`` when it takes a batch of same-size tiles; a ValueError otherwise.
    ``options`` are those of the path taken (token budgets and ``max_frames`` for packed towers, tile buckets for
    fixed-tile ones; ``max_items`` and VGraphConfig fields for both)."""
    if isinstance(tower, (CompiledVisionTower, CompiledTileTower)):
        tower = tower.tower
    if is_packed_tower(tower):
        return compile_packed_tower(tower, **options)
    if is_tile_tower(tower):
        return compile_tile_tower(tower, **options)
    raise ValueError(
        f"{type(tower).__name__} is not a vision tower vgraph can serve: its forward takes neither a grid (grid_thw, "
        "image_grid_thw...) of packed variable-size images nor pixel_values of one fixed image size. Pass the vision "
        "tower of a transformers VLM (model.visual, model.vision_tower...), or compile a custom encoder with "
        "vgraph_compile.encoder"
    )


def _is_tower(module: torch.nn.Module, vision_config: Any) -> bool:
    if isinstance(module, (CompiledVisionTower, CompiledTileTower)):
        return True
    config_matches = vision_config is None or getattr(module, "config", None) is vision_config
    return config_matches and (is_packed_tower(module) or is_tile_tower(module))


def find_vision_tower(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module holding the vision tower, the attribute name): the shallowest submodule of ``model`` that is a
    vision tower (a compiled one, or a packed or fixed-tile tower whose config is the model's ``vision_config``, when
    the model has one)."""
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    found = []
    for path, module in model.named_modules():
        if not path:
            continue
        if _is_tower(module, vision_config):
            found.append(path)
    if not found:
        raise ValueError(
            f"compile_vlm found no vision tower in {type(model).__name__}: no submodule takes packed patch rows with "
            "a grid (grid_thw, image_grid_thw...) or pixel_values of one fixed image size. Compile its tower with vgraph_compile.hf.compile_vision_tower, or "
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
    if isinstance(tower, (CompiledVisionTower, CompiledTileTower)):
        tower = tower.tower
    setattr(owner, attribute, compile_vision_tower(tower, **options))
    log.info("%s: vision tower %s (.%s) served by vgraph", type(model).__name__, type(tower).__name__, attribute)
    return model
