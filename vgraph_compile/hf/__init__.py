"""Hugging Face integration: ``compile_vlm(model)`` for whole Qwen2-VL, Qwen2.5-VL and Qwen3-VL(-MoE) models, and
``compile_vision_tower(model.visual)`` for their vision towers, unmodified, with their own weights.

``tower = compile_vision_tower(model.visual, token_budgets=[...], max_items=8)`` then
``tower(pixel_values, grid_thw)`` returns what ``model.visual(pixel_values, grid_thw)`` returns (pooler_output,
last_hidden_state, Qwen3's deepstack_features), from CUDA graphs. Requires transformers >= 5.23 (the towers
accept precomputed grid metadata as keywords).
"""

from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.vision_tower import CompiledVisionTower, compile_vision_tower
from vgraph_compile.hf.vlm import compile_vlm

__all__ = ["CompiledVisionTower", "compile_vision_tower", "compile_vlm", "routed_attention"]
