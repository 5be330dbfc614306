import pytest
import torch

from vgraph_compile.models.qwen_towers import TOY_SIZES

transformers = pytest.importorskip("transformers", minversion="5.23")

__all__ = ["TOY_SIZES"]


@pytest.fixture(scope="module")
def towers():
    from vgraph_compile.models.qwen_towers import qwen_tower

    return {name: qwen_tower(name, device="cpu", dtype=torch.float32, **size) for name, size in TOY_SIZES.items()}
