"""tower_flops counts what a tower runs, for any family: it equals a hand count of a tiny tower (linears
2 * rows * in * out, convolution per patch, attention 4 * sum(L^2) * width over the full layer's one segment and
the window layer's windows), under ``torch.no_grad`` and under ``torch.inference_mode`` alike, with the attention
share split from the rest; separate items add up, and the count lies between every weight touching each merged
token once and each patch once. A tile tower's SDPA counts as attention on the CPU too."""

import pytest
import torch

from vgraph_compile.bench.flops import count_flops, tower_flop_split, tower_flops
from vgraph_compile.bench.tile_towers import build_tile_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower

pytest.importorskip("transformers", minversion="5.23")


def linear(rows: int, inputs: int, outputs: int) -> int:
    return 2 * rows * inputs * outputs


def attention(lengths: list[int], width: int) -> int:
    return 4 * sum(length * length for length in lengths) * width


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_flops_equal_a_hand_count_of_a_tiny_windowed_tower(grad_mode):
    """Qwen2.5-VL, shrunk: width 32, gated MLP 64, two blocks (block 0 windowed, block 1 full), patch 14 with 2
    frames, merge 2, merger 4 * 32 -> 128 -> 48. A 1 x 8 x 12 patch grid (96 patches, 24 merged tokens); the window
    is 112 px = 8 patches = 4 x 4 merged tokens, so the 4 x 6 merged grid splits into windows of 4 x 4 and 4 x 2
    merged tokens: 64 and 32 patches."""
    tower = build_tower("qwen2_5_vl", tiny=True)
    config = tower.config
    assert (config.hidden_size, config.intermediate_size, config.out_hidden_size) == (32, 64, 48)
    assert (len(tower.blocks), list(config.fullatt_block_indexes), config.window_size) == (2, [1], 112)
    patches, merged, width = 96, 24, 32
    patch_embedding = linear(patches, 3 * 2 * 14 * 14, width)  # Conv3d with stride = kernel: one matmul per patch
    block_linears = linear(patches, width, 3 * width) + linear(patches, width, width) + 3 * linear(patches, width, 64)
    merger = linear(merged, 4 * width, 4 * width) + linear(merged, 4 * width, 48)
    hand = patch_embedding + 2 * block_linears + attention([64, 32], width) + attention([96], width) + merger
    with grad_mode():
        assert tower_flops(tower, [(1, 8, 12)]) == hand
        split = tower_flop_split(tower, [(1, 8, 12)])
    assert split.attention == attention([64, 32], width) + attention([96], width)
    assert split.linear == hand - split.attention


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


def test_sdpa_of_a_tile_tower_counts_as_attention_on_the_cpu():
    """InternViT shrunk: 32 px tiles of 8 px patches (16 patches and the CLS row: 17 rows), width 32, two layers. The
    CPU's flash SDPA kernel, which torch's counter does not count, counts 4 * 17^2 * 32 per tile and layer."""
    tower = build_tile_tower("internvit-448", True, torch.float32, "cpu")
    assert (tower.config.hidden_size, tower.config.num_hidden_layers) == (32, 2)
    pixels = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        split = count_flops(lambda: tower(pixels))
    assert split.attention == 3 * 2 * attention([17], 32)
    assert split.linear > 2 * 3 * 17 * 2 * (4 * 32 * 32)  # at least q, k, v and o of both layers
