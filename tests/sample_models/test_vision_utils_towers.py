"""The vision_utils families and their towers: found in the installed transformers, shrunk to a test size field by
field (with the fields tied to them), and built the same for the same seed."""

import torch

from vgraph_compile.sample_models.vision_utils_towers import TINY_SIZES, build_tower, family, shrunk


def test_shrunk_sets_only_the_fields_a_config_has_with_their_type():
    defaults = {"depth": 32, "hidden_size": 1280, "num_heads": 16, "patch_size": 14, "head_dim": None}
    assert shrunk(defaults, {"depth": 1, "hidden_size": 32, "width": 32, "num_heads": 2.0, "head_dim": 16}) == {
        "depth": 1,
        "hidden_size": 32,
        "head_dim": 16,
    }


def test_shrunk_cuts_the_fields_tied_to_the_layers_and_the_width():
    defaults = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "adapter_in_dim": 64,
        "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        "per_layer_config": {"0": "a", "3": "b"},
        "patch_size": 64,  # equal to the width by chance: also tied (an int equal to hidden_size)
    }
    assert shrunk(defaults, {"num_hidden_layers": 2, "hidden_size": 32}) == {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "adapter_in_dim": 32,
        "mlp_layer_types": ["dense", "sparse"],
        "per_layer_config": {"0": "a"},
        "patch_size": 32,
    }


def test_window_towers_keep_a_window_block_and_a_full_attention_block():
    defaults = {"depth": 32, "fullatt_block_indexes": [7, 15, 23, 31]}
    assert shrunk(defaults, TINY_SIZES) == {"depth": 2, "fullatt_block_indexes": [1]}


def test_a_tiny_tower_is_the_familys_class_shrunk_and_the_same_for_a_seed():
    tower = build_tower("qwen2_vl", tiny=True)
    assert isinstance(tower, family("qwen2_vl").tower_class) and not tower.training
    assert tower.config.depth == TINY_SIZES["depth"] and tower.config.embed_dim == TINY_SIZES["embed_dim"]
    again = build_tower("qwen2_vl", tiny=True)
    assert all(torch.equal(a, b) for a, b in zip(tower.state_dict().values(), again.state_dict().values()))
