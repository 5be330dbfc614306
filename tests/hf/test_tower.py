"""compile_vision_tower on toy Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers: equal to the eager tower (same attention
op) on generated grids, through the one-batch, split and eager-fallback paths; input checks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention

# (t, h, w) in patches: images and short videos, thin strips, and the smallest 2x2 merged grid (4 x 4 patches)
rows = st.tuples(st.sampled_from([1, 1, 2, 3]), st.sampled_from([4, 4, 8, 12, 16]), st.sampled_from([4, 8, 12, 20, 4]))
grids = st.lists(rows, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def compiled(towers):
    return {
        name: compile_vision_tower(
            tower, token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa"
        )
        for name, tower in towers.items()
    }


def _inputs(tower, grid):
    grid_thw = torch.tensor(grid)
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    return torch.randn(int(grid_thw.prod(-1).sum()), width), grid_thw


def _assert_same(out, ref, item_order_hidden=True):
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-5)
    if out.last_hidden_state is not None or item_order_hidden:
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(
        getattr(out, "deepstack_features", None) or (), getattr(ref, "deepstack_features", None) or ()
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
@given(grid=grids)
def test_equal_to_eager_tower(towers, compiled, name, grid):
    tower = towers[name]
    pixel_values, grid_thw = _inputs(tower, grid)
    with torch.no_grad():
        out = compiled[name](pixel_values, grid_thw)
        with routed_attention(tower):
            ref = tower(pixel_values, grid_thw)
    assert type(out) is type(ref)
    _assert_same(out, ref, item_order_hidden=name != "qwen2.5-vl")
    stock = tower(pixel_values, grid_thw)  # transformers' own sdpa path, per segment
    torch.testing.assert_close(out.pooler_output, stock.pooler_output.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_split_and_eager_fallback_paths(towers, compiled, name):
    """5 items over max_items=3 are split into budget-sized calls; a 24x24 image (576 > 512) runs eagerly."""
    tower, tower_compiled = towers[name], compiled[name]
    grid = [(1, 8, 8), (1, 4, 12), (1, 24, 24), (2, 4, 4), (1, 8, 4)]
    pixel_values, grid_thw = _inputs(tower, grid)
    before = tower_compiled.split_calls
    with torch.no_grad(), counters.expect(replays=2, eager_fallbacks=1):
        out = tower_compiled(pixel_values, grid_thw)
    with torch.no_grad(), routed_attention(tower):
        ref = tower(pixel_values, grid_thw)
    assert tower_compiled.split_calls == before + 1
    _assert_same(out, ref, item_order_hidden=name != "qwen2.5-vl")


@pytest.mark.parametrize(
    "grid, rows, message",
    [
        ([(1, 4, 5)], 20, "multiples of the spatial merge size 2"),
        ([(1, 4, 4)], 15, "has 15 rows but grid_thw describes sum\\(t\\*h\\*w\\) = 16"),
        ([(0, 4, 4)], 0, "must be positive"),
    ],
)
def test_bad_input_raises_before_anything_runs(towers, compiled, grid, rows, message):
    tower = towers["qwen2-vl"]
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    with counters.expect(), pytest.raises(ValueError, match=message):
        compiled["qwen2-vl"](torch.randn(rows, width), torch.tensor(grid))
    with pytest.raises(ValueError, match="is torch.float64 on cpu but the tower is torch.float32"):
        compiled["qwen2-vl"](torch.randn(16, width, dtype=torch.float64), torch.tensor([(1, 4, 4)]))


@pytest.mark.parametrize("name, patch_width, deepstack", [("qwen2-vl", 1176, None), ("qwen3-vl", 1536, 1)])
def test_empty_batch(compiled, name, patch_width, deepstack):
    """No items: empty outputs of the right widths (blocks 32 wide, merger 48), deepstack levels included."""
    out = compiled[name](torch.randn(0, patch_width), torch.zeros(0, 3, dtype=torch.int64))
    assert out.pooler_output.shape == (0, 48) and out.last_hidden_state.shape == (0, 32)
    assert len(getattr(out, "deepstack_features", None) or ()) == (deepstack or 0)


def test_unknown_tower_is_refused():
    with pytest.raises(ValueError, match="is not a vision tower vgraph knows"):
        compile_vision_tower(torch.nn.Linear(2, 2))
