"""compile_vision_tower on toy Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers: equal to the eager tower (same attention
op) on generated grids, through the one-batch, split and eager-fallback paths; input checks. The other kernels and
call choices run on one family each (every family with ``HYPOTHESIS_PROFILE=thorough``)."""

import functools
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import THOROUGH, counter_changes, outputs_from_threads
from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention
from vgraph_compile.hf.whole_graph.whole_tower import asks_nothing
from vgraph_compile.hf.interface.packed_tower import learn_packed_tower
from vgraph_compile.serve import call_costs
from vgraph_compile.serve import runtime as runtime_module
from vgraph_compile.serve.call_costs import CallCosts
from vgraph_compile.sample_models.vision_utils_towers import build_tower

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


@functools.cache
def _patch_width(tower) -> int:
    (width,) = learn_packed_tower(tower).pixel_shape
    return width


def _inputs(tower, grid):
    grid_thw = torch.tensor(grid)
    width = _patch_width(tower)
    return torch.randn(int(grid_thw.prod(-1).sum()), width), grid_thw


def _assert_same(out, ref):
    """Every field, Qwen2.5-VL's window-permuted last_hidden_state included (split calls too)."""
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(
        getattr(out, "deepstack_features", None) or (), getattr(ref, "deepstack_features", None) or ()
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
@settings(max_examples=10 if THOROUGH else 5)  # each example runs the served tower and two eager ones
@given(grid=grids)
def test_equal_to_eager_tower(towers, compiled, name, grid):
    tower = towers[name]
    pixel_values, grid_thw = _inputs(tower, grid)
    with torch.no_grad():
        out = compiled[name](pixel_values, grid_thw)
        with routed_attention(tower):
            ref = tower(pixel_values, grid_thw)
    assert type(out) is type(ref)
    _assert_same(out, ref)
    with torch.no_grad():
        stock = tower(pixel_values, grid_thw)  # transformers' own sdpa path, per segment
    torch.testing.assert_close(out.pooler_output, stock.pooler_output, rtol=1e-4, atol=1e-5)


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
    _assert_same(out, ref)


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
    width = _patch_width(tower)
    with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
        compiled["qwen2-vl"](torch.randn(rows, width), torch.tensor(grid))
    with torch.no_grad(), pytest.raises(ValueError, match="is torch.float64 on cpu but the tower is torch.float32"):
        compiled["qwen2-vl"](torch.randn(16, width, dtype=torch.float64), torch.tensor([(1, 4, 4)]))
    with torch.no_grad(), pytest.raises(ValueError, match="hidden_states must be a torch.Tensor, got ndarray"):
        compiled["qwen2-vl"](torch.randn(16, width).numpy(), torch.tensor([(1, 4, 4)]))


def test_a_grid_checked_once_is_served_alike_and_a_bad_one_raises_every_time(towers, compiled):
    """A grid's later calls take its check from ``_checked_grids`` and equal its first call; a bad grid is never kept,
    so it raises on every call; a new grid is checked and kept."""
    tower, served = towers["qwen2.5-vl"], compiled["qwen2.5-vl"]
    pixels, grid_thw = _inputs(tower, [(1, 4, 8), (2, 4, 4)])
    with torch.no_grad():
        first = served(pixels, grid_thw)
        assert ((1, 4, 8), (2, 4, 4)) in served._checked_grids
        _assert_same(served(pixels, grid_thw.clone()), first)
        for _ in range(2):
            with counters.expect(), pytest.raises(ValueError, match="multiples of the spatial merge size 2"):
                served(torch.randn(20, pixels.shape[1]), torch.tensor([(1, 4, 5)]))
        assert ((1, 4, 5),) not in served._checked_grids
        new_pixels, new_grid = _inputs(tower, [(1, 8, 4)])
        _assert_same(served(new_pixels, new_grid), tower(new_pixels, grid_thw=new_grid))


def test_a_budget_the_tower_cannot_take_raises_not_a_slower_tier(towers):
    """A token budget that is no multiple of a merge unit (2 x 2 patches) is the caller's error: a ValueError
    naming it, before any compile, not the block-graph tier standing in for a tower that traces whole."""
    served = compile_vision_tower(towers["qwen2-vl"], token_budgets=[250], compiler="eager", attention_backend="sdpa")
    with counter_changes() as changes, torch.no_grad(), pytest.raises(ValueError, match="budget 250 breaks"):
        served.warmup()
    assert changes["compiles"] == 0 and served.replacement is None


@pytest.mark.parametrize("name, patch_width, deepstack", [("qwen2-vl", 1176, None), ("qwen3-vl", 1536, 1)])
def test_empty_batch(compiled, name, patch_width, deepstack):
    """No items: empty outputs of the right widths (blocks 32 wide, merger 48), deepstack levels included."""
    with torch.no_grad():
        out = compiled[name](torch.randn(0, patch_width), torch.zeros(0, 3, dtype=torch.int64))
    assert out.pooler_output.shape == (0, 48) and out.last_hidden_state.shape == (0, 32)
    assert len(getattr(out, "deepstack_features", None) or ()) == (deepstack or 0)


def test_unknown_tower_is_refused():
    with pytest.raises(ValueError, match="is not a vision tower vgraph can serve: its forward takes neither a grid"):
        compile_vision_tower(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_stands_in_for_the_tower_inside_its_parent(towers, compiled, name):
    """Same state_dict keys and parameter names as the plain tower at model.visual; loads its checkpoint strictly;
    the attributes the models read come from the tower."""
    tower, tower_compiled = towers[name], compiled[name]
    plain, served = torch.nn.Module(), torch.nn.Module()
    plain.visual, served.visual = tower, tower_compiled
    assert list(served.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in served.named_parameters()] == [n for n, _ in plain.named_parameters()]
    served.load_state_dict(plain.state_dict(), strict=True)
    assert all(a is b for a, b in zip(tower_compiled.parameters(), tower.parameters()))
    assert (tower_compiled.dtype, tower_compiled.spatial_merge_size) == (torch.float32, 2)
    assert tower_compiled.config is tower.config
    if name == "qwen3-vl":
        assert tower_compiled.deepstack_merger_list is tower.deepstack_merger_list
    tower_compiled.train()
    assert tower.training and all(m.training for m in tower.modules())
    tower_compiled.eval()
    assert not tower.training and not any(m.training for m in tower.modules())


def test_grad_enabled_call_runs_the_stock_tower(towers, compiled):
    """Fine-tuning: with grad enabled no graph runs, the tower's own attention serves it, and gradients flow."""
    tower, tower_compiled = towers["qwen2.5-vl"], compiled["qwen2.5-vl"]
    pixel_values, grid_thw = _inputs(tower, [(1, 8, 8), (1, 4, 12)])
    before = tower_compiled.stock_calls
    with counters.expect():
        out = tower_compiled(pixel_values, grid_thw)
    assert tower_compiled.stock_calls == before + 1 and out.pooler_output.grad_fn is not None
    torch.testing.assert_close(out.pooler_output, tower(pixel_values, grid_thw).pooler_output)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_pixel_stays_in_its_image(towers, compiled, name, poison):
    """One NaN or Inf pixel in image 0 of a call: image 1's features are finite and equal the clean call's."""
    pixel_values, grid_thw = _inputs(towers[name], [(1, 8, 8), (1, 8, 12)])
    poisoned = pixel_values.clone()
    poisoned[5, 3] = poison
    with torch.no_grad():
        clean = compiled[name](pixel_values, grid_thw).pooler_output
        out = compiled[name](poisoned, grid_thw).pooler_output
    first = 8 * 8 // 4  # image 0's merged rows
    assert not out[:first].isfinite().all()  # the poison did reach its own image
    assert out[first:].isfinite().all()
    torch.testing.assert_close(out[first:], clean[first:], rtol=1e-6, atol=1e-6)


@torch._dynamo.config.patch(recompile_limit=1)
def test_many_towers_in_one_process_each_served_by_its_own_trace():
    """Two towers compiled in one process, past dynamo's per-code recompile limit (lowered to 1, so two one-block
    towers show it cheaply; the default is 8): each traces its own forward, so every one is served by graph
    replays, none falls back to eager."""
    tower = build_tower("qwen2_vl", tiny=True)
    pixel_values, grid_thw = _inputs(tower, [(1, 4, 8)])
    with torch.no_grad():
        ref = tower(pixel_values, grid_thw)
    for _ in range(2):
        served = compile_vision_tower(
            tower, token_budgets=[64], max_items=1, compiler="eager", attention_backend="sdpa"
        )
        before = counters.snapshot()
        with torch.no_grad():
            out = served(pixel_values, grid_thw)
        after = counters.snapshot()
        assert after["replays"] > before["replays"] and after["eager_fallbacks"] == before["eager_fallbacks"]
        _assert_same(out, ref)


def test_a_keyword_is_dropped_only_when_it_asks_for_what_the_traced_call_did():
    """None, a named parameter's own default, or False for a flag taken through **kwargs: dropped (the graphs
    serve the call); a named flag set against its default is kept (the stock tower serves it)."""

    def forward(pixel_values, grid_thw, use_merger=True, scale=1.0, **kwargs):
        return pixel_values

    defaults = {name: p.default for name, p in inspect.signature(forward).parameters.items() if name != "kwargs"}
    assert asks_nothing(defaults, "use_merger", True) and asks_nothing(defaults, "scale", 1.0)
    assert asks_nothing(defaults, "output_router_logits", False) and asks_nothing(defaults, "use_cache", None)
    assert not asks_nothing(defaults, "use_merger", False)
    assert not asks_nothing(defaults, "scale", 2.0)
    assert not asks_nothing(defaults, "output_router_logits", True)
    assert not asks_nothing(defaults, "grid_thw", False)  # a parameter without a default


def test_a_later_compile_of_the_tower_serves_from_its_saved_plan(towers, tmp_path):
    """compile_vision_tower of the same tower in a fresh dynamo state (as a new process) with the same artifact
    directory: the warm-up serves from the plan the first compile saved (no trace), every call is a replay equal
    to the stock tower, and bad input is refused as before."""
    tower = towers["qwen2.5-vl"]
    options = dict(token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa")
    pixel_values, grid_thw = _inputs(tower, [(1, 8, 12), (2, 4, 4)])
    with torch.no_grad():
        with routed_attention(tower):
            ref = tower(pixel_values, grid_thw)
        torch._dynamo.reset()
        # the interface probed (3 forwards of the shrunk tower); the decorator's plan and the backend's graph plan
        # saved; the warm-up and the call replayed; rewritten in both copies: the 2 sites' kernel, the patch conv
        with counters.expect(probe_forwards=3, traces=1, sites_found=2, nodes_rewritten=6, buckets_built=2,
                             plans_saved=2, replays=2):  # fmt: skip
            compile_vision_tower(tower, artifact_dir=str(tmp_path), **options)(pixel_values, grid_thw)
        torch._dynamo.reset()
        warm = compile_vision_tower(tower, artifact_dir=str(tmp_path), **options)
        with counters.expect(plans_loaded=1, buckets_built=2, replays=2):
            _assert_same(warm(pixel_values, grid_thw), ref)
        with pytest.raises(ValueError, match="hidden_states has 96 rows but grid_thw describes"):
            warm(pixel_values[:96], grid_thw)


def test_the_window_group_is_sized_by_the_window_bound(towers, compiled):
    """Qwen2.5-VL's window attention gets the window bound (not the token budget) and its full attention the frame
    bound: the tower's ``cu_window_seqlens`` is found in the trace under TowerCall's input name."""
    tower = compiled["qwen2.5-vl"]
    with torch.inference_mode():
        tower.warmup()
    for bucket in tower.runtimes[0].buckets:
        bounds = tower.geometry.bounds(bucket.shape.budget, 3, 6)
        shapes = sorted(zip(bucket.shape.segments, bucket.shape.max_seqlen))
        assert shapes == sorted([(bounds.windows, bounds.max_seqlen_window), (bounds.segments, bounds.max_seqlen_full)])
        assert bounds.max_seqlen_window < bounds.max_seqlen_full


def test_threads_with_their_own_grids_get_their_own_rows(towers, compiled):
    """Four threads call one compiled tower, each with its own grid, repeatedly (each grid's metadata staged at its
    first call and copied in after): every call is a graph replay and every output equals that grid's
    single-threaded one."""
    tower = compiled["qwen2.5-vl"]
    grids = [[(1, 8, 8)], [(1, 4, 12), (2, 4, 4)], [(1, 16, 8)], [(1, 8, 12), (1, 4, 4)]]
    calls = [_inputs(towers["qwen2.5-vl"], grid) for grid in grids]
    with torch.no_grad():
        expected = [tower(*call) for call in calls]
    stock_calls = tower.stock_calls
    with counter_changes() as changes:
        results = outputs_from_threads(lambda index: tower(*calls[index]), len(calls))
    assert changes["replays"] == 5 * len(calls) and tower.stock_calls == stock_calls, changes
    for outs, ref in zip(results, expected):
        for out in outs:
            _assert_same(out, ref)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen3-vl"])
def test_every_way_of_passing_pixels_and_grid_is_served_alike(towers, compiled, name):
    """By position, with the grid by name (both bound without ``inspect``), by the tower's own names and with
    ``return_dict=False`` (bound by its signature): the same rows, each call one replay."""
    tower = towers[name]
    pixel_values, grid_thw = _inputs(tower, [(1, 8, 8), (1, 4, 12)])
    pixels, grid = list(inspect.signature(tower.forward).parameters)[:2]
    served = compiled[name]
    with torch.no_grad():
        served(pixel_values, grid_thw)
        with counters.expect(replays=4):
            outputs = [
                served(pixel_values, grid_thw),
                served(pixel_values, **{grid: grid_thw}),
                served(**{pixels: pixel_values, grid: grid_thw}),
                served(pixel_values, grid_thw, return_dict=False),
            ]
        with routed_attention(tower):
            ref = tower(pixel_values, grid_thw)
    for out in outputs[:3]:
        _assert_same(out, ref)
    torch.testing.assert_close(outputs[3][0], ref.to_tuple()[0], rtol=1e-5, atol=1e-5)


MEASURED_COSTS = CallCosts(budgets=(128, 512), replay_ms=(2.0, 8.0), exact_ms=(3.0, 12.0))
"""The cost table the measured-choice test decides on: each bucket's replay and the compiled code at its sizes, in
ms, as the warm-up measures them on a quiet machine (the larger bucket four times the smaller)."""
STOCK_MS = 0.5
"""Every timed stock call of that test, in ms: below every other choice, as the toy tower's own forward on a few
dozen rows is on the CPU."""


def test_measured_choice_serves_by_the_stock_tower_or_the_compiled_code_alike(towers, monkeypatch):
    """With call_choice="measured", the first two calls of a bucket run the stock tower (its own sdpa attention,
    not vgraph's op), the second timed (the first is its cold start); every later call takes the cheapest of replay,
    exact size and stock. Each equals the stock tower, and stats_table counts the choices.

    The warm-up and the stock calls are timed for real, but the choice reads fixed times (``MEASURED_COSTS``,
    ``STOCK_MS``): a timing taken on a loaded machine cannot change which route a call takes. A stock call no faster
    than the 512 bucket would send the third call to a replay; a 96-row call further than a quarter from the timed
    64-row one is timed again, so the stock module serves all four calls."""
    measured = []

    def fixed_costs(buckets, *args):
        measured.append(call_costs.measure_call_costs(buckets, *args))  # the real timing of every bucket
        return MEASURED_COSTS

    def fixed_stock_ms(fn, *args, **kwargs):
        call_costs.median_ms(fn, *args, **kwargs)  # the real stock call, timed
        return STOCK_MS

    monkeypatch.setattr(runtime_module, "measure_call_costs", fixed_costs)
    monkeypatch.setattr(runtime_module, "median_ms", fixed_stock_ms)
    tower = towers["qwen3-vl"]
    served = compile_vision_tower(
        tower, token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", call_choice="measured"
    )
    with torch.no_grad():
        for grid in ([(1, 8, 8)], [(1, 8, 8)], [(1, 16, 12), (2, 4, 4)], [(1, 8, 12)]):
            pixel_values, grid_thw = _inputs(tower, grid)
            out = served(pixel_values, grid_thw)
            _assert_same(out, tower(pixel_values, grid_thw))
    (runtime,) = served.runtimes
    assert [costs.budgets for costs in measured] == [MEASURED_COSTS.budgets] and runtime.costs == MEASURED_COSTS
    assert sum(runtime.choices.values()) == 5  # the four calls and the warm-up's synthetic image
    # the first two calls of bucket 128 (cold, then timed), the first of bucket 512 (cold, untimed: a stock call of
    # fewer rows took less than its replay), and the 96-row call (timed: past the reach of the 64-row timing)
    assert runtime.choices["stock module"] == 4, runtime.choices
    assert runtime.stock_ms == {128: [(64, STOCK_MS), (96, STOCK_MS)]}  # 512's one call was its cold start, untimed
    assert "per-call choice (measured): padded to the smallest bucket x" in served.stats_table()


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"] if THOROUGH else ["qwen3-vl"])
def test_dense_sdpa_kernel_serves_the_tower_equal_to_the_stock_tower(towers, name):
    """Every site on the dense kernel (one SDPA over the bucket's rows, segments and windows apart by separation
    columns): padded buckets, several images and a video equal the stock tower."""
    tower = towers[name]
    served = compile_vision_tower(
        tower, token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", attention_backend="dense_flash"
    )
    with torch.no_grad():
        for grid in ([(1, 8, 8)], [(1, 16, 12), (2, 4, 4)], [(1, 4, 8), (1, 8, 4), (3, 8, 8)]):
            pixel_values, grid_thw = _inputs(tower, grid)
            _assert_same(served(pixel_values, grid_thw), tower(pixel_values, grid_thw))
    (runtime,) = served.runtimes
    assert runtime.hits == 4  # the three calls and the warm-up's synthetic image


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"] if THOROUGH else ["qwen2.5-vl"])
def test_exact_size_choice_runs_the_compiled_tower_unpadded_equal_to_the_stock_tower(towers, name):
    """call_choice="exact_size": every call runs the compiled code at its own sizes (window index, offsets and
    position ids unpadded), no replay, equal to the stock tower."""
    tower = towers[name]
    served = compile_vision_tower(
        tower, token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", call_choice="exact_size"
    )
    with torch.no_grad():
        served.warmup()
        with counters.expect(replays=0):
            for grid in ([(1, 8, 8)], [(1, 16, 12), (2, 4, 4)], [(1, 4, 8), (1, 8, 4), (3, 8, 8)]):
                pixel_values, grid_thw = _inputs(tower, grid)
                _assert_same(served(pixel_values, grid_thw), tower(pixel_values, grid_thw))
    (runtime,) = served.runtimes
    assert runtime.choices["compiled code at the exact size"] == 4  # the three calls and the warm-up's image
