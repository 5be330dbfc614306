import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")


TOY_SIZES = {
    "qwen2-vl": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2),
    "qwen2.5-vl": dict(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=48, fullatt_block_indexes=[1]
    ),
    "qwen3-vl": dict(
        depth=2,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=48,
        deepstack_visual_indexes=[0],
        num_position_embeddings=64,
    ),
}
"""The three Qwen tower families at toy sizes (2 blocks, width 32); the rest of each config as released."""


@pytest.fixture(scope="module")
def towers():
    from vgraph_compile.models.qwen_towers import qwen_tower

    return {name: qwen_tower(name, device="cpu", dtype=torch.float32, **size) for name, size in TOY_SIZES.items()}
