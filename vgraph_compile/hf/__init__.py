"""Hugging Face integration, one way in (``hf/vlm``): ``compile_vlm(model)`` for a whole transformers VLM, and
``compile_vision_tower(tower)`` for its tower, unmodified, with its own weights. Packed towers pack variable-size
images with a grid (the ``transformers.vision_utils`` families: Qwen2-VL to Qwen3.5, ERNIE 4.5-VL, EXAONE 4.5,
dots3, Cohere Compass, Kimi K2.5...); fixed-tile towers take ``pixel_values[N, C, H, W]``. Nothing is per family:
the tower's grid metadata, geometry and outputs are learned from the tower (``packed_tower``). Tiers: the
whole-tower graph (``whole_tower``, ``tiles``; over a process group, ``parallel_tower``) where the whole forward is
one graph, block graphs (``block_graphs``) where the forward does host work, and the exact-size code
(``exact_size_tower``) where not even its blocks can be one graph: the tower's forward compiled at each call's
sizes, or the stock tower for the calls where that measured slower.

``tower = compile_vision_tower(model.visual, token_budgets=[...], max_items=8)`` then
``tower(pixel_values, grid_thw)`` returns what ``model.visual(pixel_values, grid_thw)`` returns (the tower's own
output object), from CUDA graphs. A tower whose stock forward fails on videos is served on images only, and a
video call is refused with the reason. Requires transformers >= 5.23 (the towers accept precomputed grid metadata
as keywords).

Order, and why (from the bottom up):
1. ``attention`` (the towers' attention routed to vgraph's op); ``grid_metadata`` and ``metadata_plan`` (the
   host-side grid metadata, computed once per grid); ``stand_in`` and ``packed_tower`` (the tower's interface,
   learned from the tower); ``batching`` (items packed into budgets) and ``outputs`` (scattered back per item).
2. The tiers: ``tower_call`` and ``whole_tower`` (tier 1: the whole forward one graph) with ``parallel_plan``,
   ``data_parallel``, ``sequence_parallel`` and ``parallel_tower`` (its modes over a process group); ``tiles`` (tier
   1 for fixed-tile towers); ``block_program`` and ``block_graphs`` (tier 2: the block stack as graphs, the glue as
   written); ``exact_size_tower`` (tier 3: the forward compiled per call signature, measured against stock).
3. ``vlm``: ``compile_vision_tower`` picks the tier; ``compile_vlm`` finds the tower inside a VLM. ``server``:
   transformers' HTTP server with every VLM's tower compiled at load.
"""

from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.block_graphs import CompiledBlockTower
from vgraph_compile.hf.exact_size_tower import CompiledExactSizeTower
from vgraph_compile.hf.tiles import CompiledTileTower
from vgraph_compile.hf.whole_tower import CompiledVisionTower
from vgraph_compile.hf.vlm import compile_vision_tower, compile_vlm

__all__ = [
    "CompiledBlockTower", "CompiledExactSizeTower", "CompiledTileTower", "CompiledVisionTower", "compile_vision_tower",
    "compile_vlm",
    "routed_attention",
]
