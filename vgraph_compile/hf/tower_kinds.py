"""The Qwen vision towers vgraph knows, looked up by class name: geometry from the config, the host-side metadata
each forward would otherwise compute from ``grid_thw`` (with host syncs), and how to read its outputs.

Metadata comes from transformers' own ``vision_utils`` helpers (the same functions the towers call), run on the
CPU once per distinct grid and cached; the towers pop these keywords instead of recomputing them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from vgraph_compile.geometry import VisionGeometry

__all__ = ["TowerKind", "TOWER_KINDS", "kind_of", "hidden_width", "Grid"]

Grid = tuple[tuple[int, int, int], ...]
"""``grid_thw`` as a hashable tuple of (t, h, w) rows, in patches."""


def _frames(tower, grid: torch.Tensor) -> dict:
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    cu_seqlens = get_vision_cu_seqlens(grid)
    return {
        "position_ids": get_vision_position_ids(grid, tower.spatial_merge_size),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
    }


def _windows(tower, grid: torch.Tensor) -> dict:
    from transformers.vision_utils import get_vision_window_index

    window_index, cu_window_seqlens = get_vision_window_index(
        grid,
        spatial_merge_size=tower.spatial_merge_size,
        window_size=tower.window_size,
        patch_size=tower.patch_size,
    )
    return {
        **_frames(tower, grid),
        "window_index": window_index,
        "cu_window_seqlens": cu_window_seqlens.to(torch.int32),
        "max_window_seqlen": int((cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max()),
    }


def _interpolation(tower, grid: torch.Tensor) -> dict:
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
        grid,
        num_grid_per_side=tower.num_grid_per_side,
        mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners,
        spatial_merge_size=tower.config.spatial_merge_size,
    )
    return {**_frames(tower, grid), "interp_indices": interp_indices, "interp_weights": interp_weights}


@dataclass(frozen=True)
class TowerKind:
    """How one family of towers is driven."""

    name: str
    metadata: Callable[[torch.nn.Module, torch.Tensor], dict]
    windows: bool
    deepstack: bool

    def geometry(self, tower: torch.nn.Module) -> VisionGeometry:
        config = tower.config
        return VisionGeometry(
            patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size,
            spatial_merge_size=config.spatial_merge_size,
            window_size=config.window_size if self.windows else None,
        )

    def patch_width(self, tower: torch.nn.Module) -> int:
        """Width of the tower's ``pixel_values`` rows."""
        return self.geometry(tower).patch_width(tower.config.in_channels)

    def output_class(self, tower: torch.nn.Module) -> type:
        module = sys.modules[type(tower).__module__]
        name = "BaseModelOutputWithDeepstackFeatures" if self.deepstack else "BaseModelOutputWithPooling"
        return getattr(module, name)


_QWEN2 = TowerKind("qwen2-vl", _frames, windows=False, deepstack=False)
_QWEN25 = TowerKind("qwen2.5-vl", _windows, windows=True, deepstack=False)
_QWEN3 = TowerKind("qwen3-vl", _interpolation, windows=False, deepstack=True)

TOWER_KINDS: dict[str, TowerKind] = {
    "Qwen2VisionTransformerPretrainedModel": _QWEN2,
    "Qwen2_5_VisionTransformerPretrainedModel": _QWEN25,
    "Qwen3VLVisionModel": _QWEN3,
    "Qwen3VLMoeVisionModel": _QWEN3,
}


def hidden_width(config) -> int:
    """Width of the blocks' hidden states (Qwen2-VL calls it ``embed_dim``; its ``hidden_size`` is the merger's)."""
    return getattr(config, "embed_dim", None) or config.hidden_size


def kind_of(tower: torch.nn.Module) -> TowerKind:
    name = type(tower).__name__
    if name not in TOWER_KINDS:
        raise ValueError(
            f"{name} is not a vision tower vgraph knows ({sorted(TOWER_KINDS)}): pass model.visual of a "
            "Qwen2-VL, Qwen2.5-VL or Qwen3-VL(-MoE) model, or compile a custom encoder with vgraph_compile.encoder"
        )
    return TOWER_KINDS[name]
