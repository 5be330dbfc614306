import pytest
import torch

from vgraph_compile.bench.flops import tower_flops


def test_flops_of_the_qwen25_tower_match_two_per_parameter_and_token():
    pytest.importorskip("transformers", minversion="5.23")
    from vgraph_compile.models.qwen_towers import qwen_tower

    with torch.device("meta"):
        tower = qwen_tower("qwen2.5-vl", device="meta", dtype=torch.float32)
    parameters = sum(p.numel() for p in tower.parameters())
    tokens = 96 * 96
    flops = tower_flops(tower, [(1, 96, 96)])
    assert 2 * parameters * tokens <= flops <= 1.2 * 2 * parameters * tokens  # plus attention, within 20%
