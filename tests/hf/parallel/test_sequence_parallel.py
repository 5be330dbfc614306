"""Sequence-parallel encoding: the split as a pure function (hypothesis), and groups of 2 and 3 gloo processes on
toy Qwen2.5-VL (windows, a window permutation) and Qwen3-VL (deepstack) towers and a whole tiny Qwen3-VL: every
rank's output equal to the stock tower's, greedy tokens equal to the stock model's, one image split across the
ranks, a rank with an empty slice, 3 ranks over 2 heads (heads padded), ``parallel="auto"`` counting its choices,
and mismatched batches raising on every rank.

The groups (``tests/hf/gloo_group.py``) run the checks of ``CHECKS``; the towers are the ones the data-parallel
checks compiled, switched to the mode each check tests.
"""

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tests.hf.gloo_group import (
    DESTROY_SECONDS,
    OPTIONS,
    assert_passed,
    compiled,
    inputs,
    parallel,
    passed_on_every_rank,
    single,
    tiny_vlm,
    vlm_equals_stock,
)
from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.parallel.parallel_error import output_fields
from vgraph_compile.hf.parallel.sequence_parallel import Split, localize, split_rows

WINDOWED = VisionGeometry(patch_size=14, spatial_merge_size=2, window_size=112)
"""Qwen2.5-VL's geometry: windows of 8 x 8 patches, so a band of whole windows is 8 patch rows."""
PLAIN = VisionGeometry(patch_size=16, spatial_merge_size=2)

rows = st.tuples(st.integers(1, 3), st.sampled_from([2, 4, 6, 8, 12, 16, 20]), st.sampled_from([2, 4, 6, 8, 12, 16]))


@given(grid=st.lists(rows, min_size=1, max_size=5), ranks=st.integers(2, 4), windowed=st.booleans())
def test_split_cuts_at_window_bands_and_balances(grid, ranks, windowed):
    """Slices tile the rows in order, all but the last of one size, at least rows / ranks; every cut is a
    merge-unit boundary and, with windows, a boundary of the window offsets (no window is cut)."""
    geometry = WINDOWED if windowed else PLAIN
    split = split_rows(tuple(grid), geometry, ranks, 4)
    total = sum(t * h * w for t, h, w in grid)
    assert split.total == total and split.slice_rows * ranks >= total
    assert [split.rows(r) for r in range(ranks)] == [
        (min(r * split.slice_rows, total), min((r + 1) * split.slice_rows, total)) for r in range(ranks)
    ]
    edges = set(WINDOWED.window_metadata(grid)[1].tolist()) if windowed else set(range(0, total + 1, 4))
    assert all(start in edges for start, _ in map(split.rows, range(ranks)))


def test_split_examples():
    """1792^2 on Qwen2.5-VL (128 x 128 patches, 16 bands of 1024): 8 bands a rank. One 8 x 8 image is one band:
    all on rank 0, rank 1 empty. Without windows, any merge unit: 100 patches on 3 ranks -> 36, 36, 28."""
    assert split_rows(((1, 128, 128),), WINDOWED, 2, 4) == Split(((1, 128, 128),), 16384, 2, 8192)
    assert split_rows(((1, 8, 8),), WINDOWED, 2, 4).rows(1) == (64, 64)
    assert split_rows(((1, 10, 10),), PLAIN, 3, 4).slice_rows == 36


@pytest.mark.parametrize(
    "family, reason",
    [("paddleocr_vl", "takes pixel_values with a leading batch dim"), ("glm4v", "reads grid_thw inside its graph")],
)
def test_towers_a_slice_cannot_serve_are_refused(family, reason):
    """A batched pixel layout, or a grid read inside the graph (indexed by segment, which a slice does not
    renumber): parallel='sequence' is a ValueError naming why, before anything is traced."""
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.vision_utils_towers import build_tower

    with pytest.raises(ValueError, match=f"parallel='sequence': .*{reason}; use parallel='data'"):
        compile_vision_tower(
            build_tower(family, tiny=True), token_budgets=[256], parallel="sequence", compiler="eager"
        )


# -- groups of processes (tests/hf/gloo_group.py) ----------------------------------------------------------------
CASES = {
    "one image across the ranks": [(1, 16, 24)],
    "one band: the last rank empty": [(1, 8, 8)],
    "images and a video": [(1, 8, 12), (2, 16, 8), (1, 4, 4)],
    "over the largest bucket": [(1, 24, 32)],
}
"""Grids (t, h, w) in patches; bands of whole Qwen2.5-VL windows are 8 patch rows."""

FAMILIES = {2: ["qwen2.5-vl", "qwen3-vl"], 3: ["qwen2.5-vl"]}
"""Each tower traces once per process; 3 ranks over the toy's 2 heads pad them to 3."""


def _towers_equal_stock(group):
    """Every field equal to the stock tower (sdpa attention, eager), NaN never passing; the sequence graphs served
    (not the single-process ones)."""
    ranks, largest = dist.get_world_size(group), OPTIONS["token_budgets"][-1]
    for name in FAMILIES[ranks]:
        tower = compiled(name, group)
        single_hits = sum(runtime.hits for runtime in tower.runtimes)
        with parallel(tower, "sequence") as calls, torch.no_grad():
            for seed, (case, grid) in enumerate(CASES.items()):
                pixel_values, grid_thw = inputs(tower, grid, seed)
                out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
                for mine, theirs in zip(output_fields(out), output_fields(stock), strict=True):
                    assert not mine.isnan().any(), (name, case)
                    torch.testing.assert_close(
                        mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, at=f"{name}, {case}": f"{at}: {m}"
                    )
        assert calls == {"sequence": len(CASES)}
        assert sum(runtime.hits for runtime in tower.runtimes) == single_hits  # the single-process trace never ran
        (runtime,) = tower.sequence_graphs.compiled.vgraph.runtimes
        held = sum(tower._row_split(tuple(grid), ranks).slice_rows <= largest for grid in CASES.values())
        assert runtime.hits == 1 + held  # the warm-up, and every case whose slice a bucket holds (the rest eagerly)
        assert "sequence parallel:" in tower.stats_table()


def _nan_image_leaves_the_others_equal(group):
    """A NaN in one image's pixels, sequence parallel (the other image split across the ranks): the clean image's
    merged rows equal the stock tower's on the same call and are finite; the poisoned image's are not all finite."""
    grid = [(1, 8, 8), (1, 16, 8)]
    for name in FAMILIES[dist.get_world_size(group)]:
        tower = compiled(name, group)
        pixel_values, grid_thw = inputs(tower, grid, 7)
        pixel_values[3] = float("nan")
        with parallel(tower, "sequence") as calls, torch.no_grad():
            out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
        assert calls == {"sequence": 1}
        first = 8 * 8 // 4  # merged rows of the poisoned image
        clean = out.pooler_output[first:]
        assert clean.isfinite().all(), name
        torch.testing.assert_close(clean, stock.pooler_output[first:], rtol=1e-5, atol=1e-5)
        assert not out.pooler_output[:first].isfinite().all(), name


def _auto_counts_choices_and_mismatch_raises(group):
    """auto: one dominant image goes sequence parallel, four equal ones data parallel, each counted; then item order
    differing on rank 0 raises on every rank, and the group serves the next call."""
    tower = compiled("qwen2.5-vl", group)
    rank = dist.get_rank(group)
    with parallel(tower, "auto") as calls, torch.no_grad():
        for grid in ([(1, 16, 24)], [(1, 8, 8)] * 4):
            pixel_values, grid_thw = inputs(tower, grid, 0)
            out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
            torch.testing.assert_close(out.pooler_output, stock.pooler_output, rtol=1e-5, atol=1e-5)
        assert calls == {"sequence": 1, "data": 1}
        grid = [(1, 8, 4), (1, 16, 16)]
        pixel_values, grid_thw = inputs(tower, grid if rank else grid[::-1], 0)
        with pytest.raises(ValueError, match="were called with different grid_thw"):
            tower(pixel_values, grid_thw)
        pixel_values, grid_thw = inputs(tower, grid, 0)
        out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
        torch.testing.assert_close(out.pooler_output, stock.pooler_output, rtol=1e-5, atol=1e-5)


def _stream(seed: int, count: int) -> list[list[tuple[int, int, int]]]:
    """``count`` grids of a mixed request stream: small images alone (data parallel), one dominant image or video
    alone (sequence parallel) or among small ones (both in one call), and no items."""
    rng = random.Random(seed)
    small = lambda: (1, 2 * rng.randint(2, 4), 2 * rng.randint(2, 4))  # noqa: E731
    large = lambda: (rng.choice([1, 1, 2]), 8 * rng.randint(2, 3), 8 * rng.randint(2, 3))  # noqa: E731
    kinds = [
        lambda: [small() for _ in range(rng.randint(2, 4))],
        lambda: [large()],
        lambda: [small(), large(), *(small() for _ in range(rng.randint(0, 2)))],
        lambda: [],
    ]
    return [kinds[index % len(kinds)]() if index < len(kinds) else rng.choice(kinds)() for index in range(count)]


def _auto_stream_stays_in_step(group):
    """A mixed stream through ``auto``: every call's every field equal to the single-process call of the same
    graphs, and the three modes all taken. The group runs with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which checks
    before each c10d collective (the batch check, the gathers) that every rank issues the same one, and raises on a
    mismatch; the functional all-to-alls inside the sequence graphs are not wrapped by it, and a rank that issues
    one the others do not fails the check at the group's timeout. The teardown is timed
    (``test_destroy_process_group_returns_quickly``)."""
    tower = compiled("qwen2.5-vl", group)
    with parallel(tower, "auto") as calls, torch.no_grad():
        for seed, grid in enumerate(_stream(dist.get_world_size(group), 12)):
            pixel_values, grid_thw = inputs(tower, grid, seed)
            out, alone = tower(pixel_values, grid_thw), single(tower, pixel_values, grid_thw)
            for mine, theirs in zip(output_fields(out), output_fields(alone), strict=True):
                assert mine.shape == theirs.shape, grid
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, at=grid: f"{at}: {m}")
    assert set(calls) == {"data", "sequence", "sequence+data"}, calls


def _vlm_greedy_tokens_equal_stock(group):
    """The whole tiny Qwen3-VL, sequence parallel over the group: the stock logits and greedy tokens on every
    rank, its images and video each split over the ranks."""
    model = tiny_vlm(group)[0]
    with parallel(model.model.visual, "sequence"):
        calls = vlm_equals_stock(group)
    assert calls == {"sequence": calls["sequence"]} and calls["sequence"] >= 2


def _moving_the_tower_releases_its_sequence_graphs(group):
    """``.float()`` (any ``.to()``) makes the tower trace again: its sequence-parallel graphs, which hold the
    group's communicator, are released first, not dropped while alive."""
    tower = compiled("qwen2.5-vl", group)
    with parallel(tower, "sequence"), torch.no_grad():
        tower(*inputs(tower, [(1, 16, 16)], 0))
    runtimes = tower.sequence_graphs.compiled.vgraph.runtimes
    assert runtimes and all(runtime.buckets for runtime in runtimes)
    tower.float()
    assert tower.sequence_graphs is None
    assert all(runtime.buckets == [] for runtime in runtimes)


CHECKS = {
    2: [
        _towers_equal_stock,
        _nan_image_leaves_the_others_equal,
        _auto_counts_choices_and_mismatch_raises,
        _auto_stream_stays_in_step,
        _vlm_greedy_tokens_equal_stock,
        _moving_the_tower_releases_its_sequence_graphs,
    ],
    3: [_towers_equal_stock, _auto_stream_stays_in_step],
}


test_passed_on_every_rank = passed_on_every_rank(CHECKS, apart=(_vlm_greedy_tokens_equal_stock,))


def test_a_row_index_leaving_any_slice_raises_on_every_rank():
    """Rank 1's rows of a row index read row 3, in rank 0's slice: both ranks raise (each checks every slice), so
    no rank enters the all-to-all the other skips."""
    split = Split(((1, 4, 4),), 16, 2, 8)
    index = torch.arange(16)
    index[12] = 3
    for rank in range(2):
        with pytest.raises(RuntimeError, match="outside rank 1's slice"):
            localize({"order": index}, {("order", 0): 1}, (), split, rank)






def test_vlm_greedy_tokens_equal_stock(gloo_group):
    pytest.importorskip("skimage", reason="the sample photographs come with scikit-image")
    assert_passed(gloo_group, _vlm_greedy_tokens_equal_stock, CHECKS)



def test_destroy_process_group_returns_quickly(gloo_group):
    """Every rank's ``destroy_process_group``, after every check (the towers closed first), takes under 5 s: a
    collective one rank issued and another did not would hold it up to the group's timeout."""
    ranks, results = gloo_group
    for rank, result in enumerate(results):
        assert float(result[DESTROY_SECONDS]) < 5.0, f"rank {rank} of {ranks}"
