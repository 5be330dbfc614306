"""tower_flops counts what a tower runs, for any family: separate items add up, and the count lies between every
weight touching each merged token once and each patch once (plus attention, bounded by its segments)."""

import pytest

from vgraph_compile.bench.flops import tower_flops
from vgraph_compile.models.hf_families import build_tower

pytest.importorskip("transformers", minversion="5.23")


@pytest.mark.parametrize("name", ["qwen2_5_vl", "ernie4_5_vl_moe"])
def test_flops_add_up_over_items_and_lie_between_the_weight_bounds(name):
    tower = build_tower(name, tiny=True)
    merge = tower.config.spatial_merge_size
    image = (1, 4 * merge, 6 * merge)
    one, three = tower_flops(tower, [image]), tower_flops(tower, [image] * 3)
    assert three == 3 * one  # no work crosses items
    patches = image[1] * image[2]
    parameters = sum(p.numel() for p in tower.parameters())
    width, layers = tower.config.hidden_size, len(tower.blocks)
    attention_bound = 4 * patches * patches * width * layers
    assert 2 * parameters * patches // merge**2 < one <= 2 * parameters * patches + attention_bound
    assert tower_flops(tower, [(1, 8 * merge, 12 * merge)]) > 4 * one  # attention grows faster than the patches
