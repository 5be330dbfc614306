"""The one way in for Hugging Face towers: ``compile_vision_tower(tower)`` serves a packed tower (its forward takes a
grid: ``hf/whole_graph/whole_tower``) or a fixed-tile tower (``forward(pixel_values[N, C, H, W])`` of one image size:
``hf/whole_graph/tiles``), and ``compile_vlm(model)`` finds the vision tower of a whole transformers VLM and serves it in place.

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
from typing import Any, Callable

import torch

from vgraph_compile.hf.blocks.block_graphs import CompiledBlockTower, compile_block_tower
from vgraph_compile.hf.exact_size.exact_size_tower import CompiledExactSizeTower, compile_exact_size_tower
from vgraph_compile.hf.interface.metadata_plan import TowerRefused
from vgraph_compile.hf.whole_graph.tiles import CompiledTileTower, compile_tile_tower, is_tile_tower
from vgraph_compile.hf.whole_graph.whole_tower import CompiledVisionTower, compile_packed_tower, is_packed_tower

__all__ = ["compile_vision_tower", "compile_vlm", "find_vision_tower"]

log = logging.getLogger(__name__)


CompiledTower = CompiledVisionTower | CompiledTileTower | CompiledBlockTower | CompiledExactSizeTower
_COMPILED = (CompiledVisionTower, CompiledTileTower, CompiledBlockTower, CompiledExactSizeTower)

_WHOLE_TOWER_OPTIONS = (
    "max_items", "max_frames", "exact_items", "item_growth", "parallel", "sequence_cost", "process_group",
    "max_signatures",
)
"""Options the block graphs and the exact-size code do not read: the whole-tower graph's that bound or split its
graph calls, size its tile buckets or spread them over a process group (the block graphs bound one call by
``token_budgets`` and ``max_segments`` and take the glue's own packing), and the exact-size code's
``max_signatures``, passed to it alone."""


def compile_vision_tower(tower: torch.nn.Module, **options: Any) -> CompiledTower:
    """Serve ``tower`` by the first tier that can:

    1. the whole-tower graph: ``compile_packed_tower`` when its forward takes a grid of packed variable-size images
       and everything it reads from the grid is grid metadata (when its first call's trace is refused all the same,
       block graphs take over from that call on), ``compile_tile_tower`` when it takes a batch of same-size tiles;
    2. block graphs (``compile_block_tower``): the block stack from graphs and the glue as written, for any other
       transformers tower (its forward reads the grid on the host, takes other arguments...);
    3. the exact-size code (``compile_exact_size_tower``), where its blocks cannot be graphs either (they change
       shape with the items): the tower's forward compiled at each call's sizes, or the stock tower for the calls
       where that measured slower. Only a module with no transformers config is refused, at once.

    The tier and the reasons the better ones could not serve are logged once and shown in ``stats_table()``.
    Over a ``process_group`` the whole-tower graph splits each call over the ranks; the lower tiers serve each
    rank's call whole (every rank gets the same batch and returns the whole output, as over the group).
    ``options`` are those of the tier taken (token budgets and ``max_frames`` for packed towers, tile buckets for
    fixed-tile ones; ``max_items`` and VGraphConfig fields for both; the block graphs take ``token_budgets`` and
    VGraphConfig fields; the exact-size code reads ``compiler``, ``call_choice`` and ``max_signatures``).
    """
    if isinstance(tower, _COMPILED):
        tower = tower.tower
    name = type(tower).__name__
    if is_packed_tower(tower):
        try:
            served = compile_packed_tower(tower, trace_refused=_block_graphs(tower, options), **_tier_options(options))
        except TowerRefused as refusal:
            reason = str(refusal).split(": ", 1)[-1]
        else:
            log.info("%s: served by the whole-tower graph", name)
            return served
    elif is_tile_tower(tower):
        exact_size = _exact_size(tower, options, "the tile graph")
        return compile_tile_tower(tower, trace_refused=exact_size, **_tier_options(options))
    else:
        reason = (
            "its forward takes neither a grid (grid_thw, image_grid_thw...) of packed variable-size images nor "
            "pixel_values of one fixed image size"
        )
        if getattr(tower, "config", None) is None:  # not a transformers tower: no attention to route
            raise ValueError(
                f"{name} is not a vision tower vgraph can serve: {reason}. Pass the vision tower of a transformers "
                "VLM (model.visual, model.vision_tower...), or compile a custom encoder with vgraph_compile.encoder"
            )
    if options.get("process_group") is not None:
        log.info("%s: each rank of the process_group encodes every call whole: block graphs serve one process", name)
    return _block_graphs(tower, options)(reason)


def _tier_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of the whole-tower graph (every one but the exact-size code's)."""
    return {key: value for key, value in options.items() if key != "max_signatures"}


def _block_graphs(tower: torch.nn.Module, options: dict[str, Any]) -> Callable[[str], CompiledBlockTower]:
    """Block graphs for ``tower``, made when the whole-tower graph gives the reason it cannot serve; the
    exact-size code once they give theirs."""
    name = type(tower).__name__
    exact_size = _exact_size(tower, options, "block graphs")

    def blocks(reason: str) -> CompiledBlockTower:
        log.info("%s: served by block graphs: the whole forward is not one graph: %s", name, reason)
        return compile_block_tower(tower, reason, blocks_refused=exact_size, **_lower_options(options))

    return blocks


def _exact_size(
    tower: torch.nn.Module, options: dict[str, Any], refused_by: str
) -> Callable[[str], CompiledExactSizeTower]:
    """The exact-size code for ``tower``, made when the tier above it (``refused_by``) gives its reason."""
    signatures = {"max_signatures": options["max_signatures"]} if "max_signatures" in options else {}

    def exact_size(reason: str) -> CompiledExactSizeTower:
        log.info("%s: served by the exact-size code: %s cannot serve it: %s", type(tower).__name__, refused_by, reason)
        return compile_exact_size_tower(tower, f"{refused_by}: {reason}", **_lower_options(options), **signatures)

    return exact_size


def _lower_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options the block graphs and the exact-size code take (VGraphConfig fields and token budgets)."""
    return {key: value for key, value in options.items() if key not in _WHOLE_TOWER_OPTIONS}


def _is_tower(module: torch.nn.Module, vision_config: Any) -> bool:
    """A compiled tower; a packed or fixed-tile tower whose config is ``vision_config`` (any, when None); or a
    transformers model whose config is ``vision_config``, whatever its forward takes (MiniCPM-V's tower takes
    ``target_sizes``: block graphs or the exact-size code serve it)."""
    if isinstance(module, _COMPILED):
        return True
    if vision_config is None:
        return is_packed_tower(module) or is_tile_tower(module)
    if getattr(module, "config", None) is not vision_config:
        return False
    from transformers import PreTrainedModel

    return is_packed_tower(module) or is_tile_tower(module) or isinstance(module, PreTrainedModel)


def find_vision_tower(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module holding the vision tower, the attribute name): the shallowest submodule of ``model`` that is a
    vision tower (``_is_tower``: a compiled one; a packed or fixed-tile tower; where the model has a
    ``vision_config``, only a module of that config, any transformers model of it)."""
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    found = []
    for path, module in model.named_modules():
        if not path:
            continue
        if _is_tower(module, vision_config):
            found.append(path)
    if not found:
        raise ValueError(
            f"compile_vlm found no vision tower in {type(model).__name__}: no submodule is a model of its "
            "vision_config, takes packed patch rows with a grid (grid_thw, image_grid_thw...) or pixel_values of one "
            "fixed image size. Compile its tower with vgraph_compile.hf.compile_vision_tower, or its encoder with "
            "vgraph_compile.encoder"
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
    if isinstance(tower, _COMPILED):
        tower = tower.tower
    setattr(owner, attribute, compile_vision_tower(tower, **options))
    log.info("%s: vision tower %s (.%s) served by vgraph", type(model).__name__, type(tower).__name__, attribute)
    return model
