"""The Qwen towers at toy sizes: each family's tower class with its toy fields over the released config, the
merger's output width in the field ``MERGER_WIDTH`` names, random weights fixed by the seed."""

import pytest
import torch

from vgraph_compile.sample_models.qwen_towers import MERGER_WIDTH, REAL_SIZES, TOY_SIZES, qwen_tower


@pytest.mark.parametrize("kind", list(TOY_SIZES))
def test_a_toy_tower_has_its_toy_fields_and_merger_width(kind):
    tower = qwen_tower(kind, device="cpu", dtype=torch.float32, **TOY_SIZES[kind])
    assert type(tower).__name__ == REAL_SIZES[kind][1] and not tower.training
    assert all(getattr(tower.config, field) == value for field, value in TOY_SIZES[kind].items())
    merger_out = [module for module in tower.merger.modules() if isinstance(module, torch.nn.Linear)][-1]
    assert merger_out.out_features == getattr(tower.config, MERGER_WIDTH[kind]) == 48


def test_the_seed_fixes_the_weights():
    build = lambda seed: qwen_tower("qwen2-vl", device="cpu", dtype=torch.float32, seed=seed, **TOY_SIZES["qwen2-vl"])
    first, same, other = (build(seed).state_dict() for seed in (0, 0, 1))
    assert all(torch.equal(first[name], same[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)
