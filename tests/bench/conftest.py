"""vgraph-bench's tests run without a GPU (the oracle's CUDA graph capture is marked ``gpu``)."""

import pytest
import torch


@pytest.fixture(scope="module")
def bench_tower():
    """A two-block, width-32 Qwen2.5-VL tower (windows and a full-attention block) on the CPU."""
    pytest.importorskip("transformers", minversion="5.23")
    from tests.hf.conftest import TOY_SIZES
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    return qwen_tower("qwen2.5-vl", device="cpu", dtype=torch.float32, **TOY_SIZES["qwen2.5-vl"])
