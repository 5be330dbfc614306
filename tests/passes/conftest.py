import pytest
import torch

from tests.helpers import trace
from vgraph_compile.config import VGraphConfig
from vgraph_compile.models.packed_vit import PackedViT, pack_images


@pytest.fixture
def tiny():
    """A one-block PackedViT traced on two images, with budgets (16, 64), 4 segments, the SDPA backend."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    inputs = pack_images([5, 7], 12)
    config = VGraphConfig(token_budgets=(16, 64), max_segments=4, attention_backend="sdpa")
    gm, ctx = trace(model, *inputs, config=config)
    return model, gm, ctx
