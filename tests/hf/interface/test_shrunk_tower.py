"""The shrunk tower a packed tower's interface is learned on: its config keeps every kind of block and every
layer tap in order, and what is learned on it equals what the tower itself gives."""

import pytest
import torch

from vgraph_compile.hf.interface.packed_tower import learn_packed_tower
from vgraph_compile.hf.interface.shrunk_tower import MLP_WIDTH, shrunk_config, shrunk_tower
from vgraph_compile.sample_models.qwen_towers import REAL_SIZES, TOY_SIZES, qwen_tower


def _released_config(kind: str):
    import importlib

    module_name, _, config_name, fields = REAL_SIZES[kind]
    return getattr(importlib.import_module(module_name), config_name)(**fields)


@pytest.mark.parametrize(
    "kind, depth, field, indexes",
    [
        # 32 blocks, full attention at 7, 15, 23, 31: a window block before each full one -> 8 blocks
        ("qwen2.5-vl", 8, "fullatt_block_indexes", [1, 3, 5, 7]),
        # 27 blocks, deepstack taps after 8, 16, 24: a block before each tap and one after the last -> 7 blocks
        ("qwen3-vl", 7, "deepstack_visual_indexes", [1, 3, 5]),
        # 32 identical blocks, no layer-index field -> 1 block
        ("qwen2-vl", 1, None, None),
    ],
)
def test_released_configs_shrink_to_one_block_per_run_and_tap(kind, depth, field, indexes):
    config = _released_config(kind)
    shrunk = shrunk_config(config)
    assert shrunk.depth == depth
    if field is not None:
        assert getattr(shrunk, field) == indexes
    widths = ("hidden_size", "out_hidden_size", "embed_dim", "patch_size", "spatial_merge_size", "num_heads")
    assert all(getattr(shrunk, name, None) == getattr(config, name, None) for name in widths)
    if hasattr(config, "intermediate_size"):
        assert shrunk.intermediate_size == MLP_WIDTH
    assert config.depth == REAL_SIZES[kind][3]["depth"]  # the tower's own config is left as it was


def test_a_layer_index_the_renumbering_cannot_read_keeps_the_depth():
    """A negative index (counted from the end) names a block the renumbering cannot place: all blocks stay."""
    config = _released_config("qwen2.5-vl")
    config.fullatt_block_indexes = [7, -1]
    assert shrunk_config(config).depth == 32


@pytest.mark.parametrize("kind", sorted(TOY_SIZES))
def test_the_interface_learned_on_the_shrunk_tower_is_the_towers_own(kind):
    """Everything the interface holds, learned on the shrunk tower and on the tower itself, agrees: layout,
    geometry, output fields, metadata calls and every value they compute on a video and an image."""
    tower = qwen_tower(kind, device="cpu", dtype=torch.float32, **TOY_SIZES[kind])
    shrunk, own = learn_packed_tower(tower), learn_packed_tower(tower, probe=tower)
    for name in ("grid_argument", "geometry", "pixel_shape", "metadata_patches_per_row", "output_class", "outputs",
                 "video_failure", "batched", "grid_traced"):  # fmt: skip
        assert getattr(shrunk, name) == getattr(own, name), name
    assert shrunk.metadata.describe() == own.metadata.describe()
    assert shrunk.metadata.config is tower.config
    grid = torch.tensor([(2, 4, 8), (1, 2, 2)])
    computed, expected = shrunk.metadata.compute(grid), own.metadata.compute(grid)
    assert computed.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(computed[key], value), key
        else:
            assert computed[key] == value, key


def test_the_shrunk_tower_is_built_without_touching_the_callers_random_state():
    tower = qwen_tower("qwen2.5-vl", device="cpu", dtype=torch.float32, **TOY_SIZES["qwen2.5-vl"])
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    probe = shrunk_tower(tower)
    assert torch.equal(torch.rand(4), expected)
    assert type(probe) is type(tower) and probe.config is not tower.config
    assert all(parameter.isfinite().all() for parameter in probe.parameters())
