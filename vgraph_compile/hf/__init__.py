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

The tree, each tier a folder (from the bottom up):
1. Shared by every tier: ``attention`` (the towers' attention routed to vgraph's op), ``stand_in`` (what a
   compiled tower shares with the stock one), ``outputs`` (the tower's output object per call), and
   ``interface/`` (what vgraph learns about a packed tower: its arguments, layout, geometry, and its grid metadata
   computed on the host once per grid).
2. The tiers: ``whole_graph/`` (tier 1: the whole forward one graph; packed towers and fixed tiles) with
   ``parallel/`` (its modes over a process group); ``blocks/`` (tier 2: the block stack as graphs, the glue as
   written); ``exact_size/`` (tier 3: the forward compiled per call signature, measured against stock).
3. ``vlm``: ``compile_vision_tower`` picks the tier; ``compile_vlm`` finds the tower inside a VLM. ``server``:
   transformers' HTTP server with every VLM's tower compiled at load.
"""

from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.blocks.block_graphs import CompiledBlockTower
from vgraph_compile.hf.exact_size.exact_size_tower import CompiledExactSizeTower
from vgraph_compile.hf.whole_graph.tiles import CompiledTileTower
from vgraph_compile.hf.whole_graph.whole_tower import CompiledVisionTower
from vgraph_compile.hf.vlm import compile_vision_tower, compile_vlm

__all__ = [
    "CompiledBlockTower", "CompiledExactSizeTower", "CompiledTileTower", "CompiledVisionTower", "compile_vision_tower",
    "compile_vlm",
    "routed_attention",
]
