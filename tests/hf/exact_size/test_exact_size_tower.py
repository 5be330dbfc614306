"""The tier of last resort (``hf/exact_size/exact_size_tower``): a tower whose blocks change shape with the items
(an LFM3-VL tower of convolution blocks only, built from its own config class: every block loops over the grid
list) is served by ``compile_vision_tower`` through its forward compiled at each call's sizes, equal to the stock
tower on several grids (every call counted on the path it took), concurrent callers of new and known signatures
given their own rows, a NaN image kept in its rows, bad input refused with a ValueError before anything compiles,
the path chosen per signature by the measured cost, and the signatures kept in an LRU."""

import re

import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters

from tests.helpers import outputs_from_threads
from vgraph_compile.counters import counters
from vgraph_compile.hf import CompiledExactSizeTower, compile_vision_tower
from vgraph_compile.hf.exact_size import exact_size_tower
from vgraph_compile.hf.exact_size.exact_size_tower import call_signature
from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

CONVOLUTION_BLOCKS = dict(num_hidden_layers=2, layer_types=["conv", "conv"])
"""LFM3-VL blocks that each loop over ``grid_thw.tolist()``: the block graphs have no block to serve."""
BOTH_REASONS = (
    r"the whole forward is not one graph \(it reads a grid-derived tensor on the host \(tolist\).*\), and every "
    r"block of layers reads a host list \(grid_thw\)"
)


def _served(**options):
    tower = build_tower("lfm3_vl", tiny=True, **CONVOLUTION_BLOCKS)
    options = dict(token_budgets=[256], compiler="eager", attention_backend="sdpa", **options)
    return tower, compile_vision_tower(tower, **options)


@pytest.fixture(scope="module")
def convolution_tower():
    """(the stock tower, its compiled tower always running the compiled code), after a first call."""
    tower, served = _served(call_choice="exact_size")
    args, kwargs = tower_call("lfm3_vl", tower, [(1, 4, 6)])
    with torch.no_grad():
        served(*args, **kwargs)
    return tower, served


def _exact(served):
    """The exact-size tier behind what ``compile_vision_tower`` returned (each tier hands over to the next as its
    ``replacement``)."""
    while not isinstance(served, CompiledExactSizeTower):
        served = served.replacement
    return served


def test_served_by_exact_size_code_equal_to_stock(convolution_tower):
    """One image, two, a video with an image, and the first grid again: each call runs the compiled code (counted)
    and equals the stock tower; the tier and both better tiers' reasons are in ``stats_table()``."""
    tower, served = convolution_tower
    exact = _exact(served)
    assert isinstance(exact, CompiledExactSizeTower)
    assert served.stats_table().startswith("tier: exact-size code")
    assert re.search(BOTH_REASONS, exact.tier_reason)
    for grid in ([(1, 4, 6)], [(1, 4, 4), (1, 2, 2)], [(2, 4, 4), (1, 2, 4)], [(1, 4, 6)]):
        args, kwargs = tower_call("lfm3_vl", tower, grid)
        with torch.no_grad(), counters.expect(exact_size_calls=1):
            out = served(*args, **kwargs)
        with torch.no_grad():
            ref = tower(*args, **kwargs)
        assert not out.last_hidden_state.isnan().any()
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    assert len(exact.signatures) == 3


def test_concurrent_callers_get_their_own_rows(convolution_tower):
    """Three threads at once, each on its own grid (two signatures new, one known), five calls each: every call
    equals the stock tower on its own grid."""
    tower, served = convolution_tower
    calls = [tower_call("lfm3_vl", tower, grid) for grid in ([(1, 4, 6)], [(1, 2, 6), (1, 2, 2)], [(1, 6, 4)])]
    results = outputs_from_threads(lambda index: served(*calls[index][0], **calls[index][1]).last_hidden_state, 3)
    for (args, kwargs), outputs in zip(calls, results):
        with torch.no_grad():
            ref = tower(*args, **kwargs).last_hidden_state
        for out in outputs:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_nan_image_stays_in_its_rows(convolution_tower):
    """A NaN pixel in image 0: image 1's rows are finite and equal those of the call without the NaN."""
    tower, served = convolution_tower
    (pixel_values, grid_thw), kwargs = tower_call("lfm3_vl", tower, [(1, 4, 4), (1, 2, 2)])
    with torch.no_grad():
        clean = served(pixel_values, grid_thw).last_hidden_state
        pixel_values = pixel_values.clone()
        pixel_values[3, 5] = float("nan")
        poisoned = served(pixel_values, grid_thw).last_hidden_state
    assert poisoned[:16].isnan().any()
    torch.testing.assert_close(poisoned[16:], clean[16:], rtol=0, atol=0)


def test_bad_input_raises_before_anything_compiles(convolution_tower):
    """Pixel rows that do not match the grid (the stock tower's own error, named), a float grid, a grid of a
    zero size: a ValueError, no signature kept, no frame given to dynamo."""
    tower, served = convolution_tower
    (pixel_values, grid_thw), _ = tower_call("lfm3_vl", tower, [(1, 4, 8)])
    bad = {
        r"fails on this call as written \(RuntimeError: split_with_sizes": (pixel_values[:20], grid_thw),
        r"grid_thw must be a \[items, 3\] integer tensor": (pixel_values, grid_thw.float()),
        r"every t, h, w must be positive": (pixel_values[:0], torch.tensor([(1, 0, 8)])),
    }
    kept = dict(_exact(served).signatures)
    frames = dynamo_counters["frames"]["total"]
    for message, call in bad.items():
        with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
            served(*call)
    assert dict(_exact(served).signatures) == kept
    assert dynamo_counters["frames"]["total"] == frames


@pytest.mark.parametrize("compiled_ms, serves", [(1.0, "compiled code"), (3.0, "stock tower")])
def test_each_signature_served_by_the_path_measured_faster(monkeypatch, compiled_ms, serves):
    """Measured (the default call choice): the first call of a signature times the compiled code, then the stock
    tower (2 ms here), and the faster serves that signature's calls; a tie goes to the compiled code."""
    times = iter([compiled_ms, 2.0])
    monkeypatch.setattr(exact_size_tower, "median_ms", lambda *args, **kwargs: next(times))
    tower, served = _served()
    args, kwargs = tower_call("lfm3_vl", tower, [(1, 4, 6)])
    with torch.no_grad():
        served(*args, **kwargs)
        exact = _exact(served)
        (entry,) = exact.signatures.values()
        assert entry.serves == serves
        with counters.expect(exact_size_calls=int(serves == "compiled code")):
            out = served(*args, **kwargs)
        torch.testing.assert_close(out.last_hidden_state, tower(*args, **kwargs).last_hidden_state)
    assert f"{serves} (measured" in exact.stats_table()


def test_signatures_are_kept_least_recently_used_first_out():
    """``max_signatures=2``: a third grid drops the least recently used one, whose next call is a first call again
    (checked, and its path chosen again)."""
    tower, served = _served(call_choice="stock", max_signatures=2)
    grids = [[(1, 2, 2)], [(1, 2, 4)], [(1, 2, 2)], [(1, 4, 2)]]
    calls = [tower_call("lfm3_vl", tower, grid) for grid in grids]
    with torch.no_grad():
        for args, kwargs in calls:
            served(*args, **kwargs)
    keys = [call_signature(args, kwargs) for args, kwargs in calls]
    assert list(_exact(served).signatures) == [keys[0], keys[3]]  # (1, 2, 4) was the least recently used


def test_signature_keys_small_integer_tensors_by_value():
    """Two calls of one grid share a key; another grid of the same shape, or another pixel row count, does not;
    float values are not part of it."""
    pixels = torch.randn(8, 3)
    key = call_signature((pixels, torch.tensor([(1, 2, 4)])), {})
    assert call_signature((torch.randn(8, 3), torch.tensor([(1, 2, 4)])), {}) == key
    assert call_signature((pixels, torch.tensor([(1, 4, 2)])), {}) != key
    assert call_signature((torch.randn(9, 3), torch.tensor([(1, 2, 4)])), {}) != key
    assert call_signature((pixels, torch.tensor([(1, 2, 4)])), {"return_dict": False}) != key


FIXED_TILES = {"step3p7": r"the tile graph: .*produces a data-dependent value"}
"""Fixed-tile families whose tile graph is refused at its first trace, served by the exact-size code, with the
reason the tier names."""


@pytest.mark.parametrize("name", sorted(FIXED_TILES))
def test_fixed_tile_tower_whose_trace_is_refused_is_served_equal_to_stock(name):
    """One tile, three, then one again: the first call's trace is refused, and every call (that one included) runs
    the compiled code, equal to the stock tower; a tile of another size is a ValueError before anything runs."""
    tower = build_tower(name, tiny=True, image_size=56)
    served = compile_vision_tower(tower, compiler="eager", call_choice="exact_size")
    size = tower.config.image_size
    for tiles in (1, 3, 1):
        pixel_values = torch.randn(tiles, tower.config.num_channels, size, size)
        with torch.no_grad(), counters.expect(exact_size_calls=1):
            out = served(pixel_values)
        with torch.no_grad():
            ref = tower(pixel_values)
        assert not out.last_hidden_state.isnan().any()
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    assert re.search(FIXED_TILES[name], _exact(served).tier_reason)
    assert served.stats_table().startswith("tier: exact-size code")
    with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=r"pixel_values must be \[tiles, 3, 56"):
        served(torch.randn(1, tower.config.num_channels, size, size + 14))
