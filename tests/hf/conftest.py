import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")


def small_towers():
    """The three Qwen tower families at toy sizes (2 blocks, width 32), random weights, fp32."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
        Qwen2_5_VLVisionConfig,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLVisionConfig,
    )
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionConfig, Qwen3VLVisionModel

    torch.manual_seed(0)
    return {
        "qwen2-vl": Qwen2VisionTransformerPretrainedModel._from_config(
            Qwen2VLVisionConfig(depth=2, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2),
            attn_implementation="sdpa",
        ),
        "qwen2.5-vl": Qwen2_5_VisionTransformerPretrainedModel._from_config(
            Qwen2_5_VLVisionConfig(
                depth=2,
                hidden_size=32,
                num_heads=2,
                intermediate_size=64,
                out_hidden_size=48,
                fullatt_block_indexes=[1],
            ),
            attn_implementation="sdpa",
        ),
        "qwen3-vl": Qwen3VLVisionModel._from_config(
            Qwen3VLVisionConfig(
                depth=2,
                hidden_size=32,
                num_heads=2,
                intermediate_size=64,
                out_hidden_size=48,
                deepstack_visual_indexes=[0],
                num_position_embeddings=64,
            ),
            attn_implementation="sdpa",
        ),
    }


@pytest.fixture(scope="module")
def towers():
    return {name: tower.eval() for name, tower in small_towers().items()}
