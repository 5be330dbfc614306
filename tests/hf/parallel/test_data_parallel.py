"""Data-parallel encoding: the assignment as a pure function (hypothesis), and groups of 2 and 3 gloo processes on
toy Qwen2-VL / 2.5-VL / 3-VL towers and a whole tiny Qwen3-VL: every rank's output equal to a single-process call
(every field, Qwen2.5-VL's window-permuted last_hidden_state and Qwen3-VL's deepstack features included), greedy
tokens equal to the stock model's, and mismatched batches raising on every rank.

The groups (``tests/hf/gloo_group.py``) run the checks of ``CHECKS``. The single-process call is the same
compiled tower with ``process_group=None``: the same graphs, no collective.
"""

import random

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import THOROUGH
from tests.hf.gloo_group import (
    assert_passed,
    compiled,
    inputs,
    parallel,
    passed_on_every_rank,
    single,
    tiny_vlm,
    vlm_equals_stock,
)
from vgraph_compile.hf.parallel.data_parallel import Assignment, LoadStats, assign
from vgraph_compile.hf.parallel.parallel_error import output_fields

rows = st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(1, 12))


@given(grid=st.lists(rows, max_size=12), ranks=st.integers(1, 5))
def test_every_item_once_whole_and_within_the_greedy_bound(grid, ranks):
    assignment = assign(grid, ranks)
    sizes = [t * h * w for t, h, w in grid]
    assert sorted(i for share in assignment.items for i in share) == list(range(len(grid)))
    for share, load in zip(assignment.items, assignment.loads):
        assert list(share) == sorted(share)
        assert load == sum(sizes[i] for i in share)  # every frame of an item counted on the one rank it is on
    if grid:
        assert max(assignment.loads) <= sum(sizes) / ranks + max(sizes)
    assert assign(list(grid), ranks) == assignment  # a pure function of the grid


def test_largest_first_onto_the_least_loaded_rank():
    """Sizes 64, 16, 48 (a 3-frame video), 16, 8 on 2 ranks: 64 -> 0, 48 -> 1, 16 -> 1 (64 vs 48),
    16 -> 0 (64 vs 64: lower rank), 8 -> 1 (80 vs 64)."""
    assignment = assign([(1, 8, 8), (1, 4, 4), (3, 4, 4), (1, 2, 8), (1, 2, 4)], 2)
    assert assignment == Assignment(items=((0, 3), (1, 2, 4)), loads=(80, 72))
    assert assign([(1, 4, 4)], 3) == Assignment(items=((0,), (), ()), loads=(16, 0, 0))


def test_load_table():
    stats = LoadStats()
    stats.record(assign([(1, 8, 8), (1, 4, 4), (3, 4, 4), (1, 2, 8), (1, 2, 4)], 2))
    stats.record(assign([(1, 8, 8)], 2))
    stats.record(assign([], 2))
    assert_expected_inline(
        stats.table(rank=1),
        """\
data parallel over 2 ranks (this is rank 1), 3 calls
  rank    patches   share
     0        144   66.7%
     1         72   33.3%
imbalance (max/mean patches per call): mean 1.526, worst 2.000""",
    )


# -- groups of processes (tests/hf/gloo_group.py) ----------------------------------------------------------------
def _random_grid(seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([1, 1, 2]), 2 * rng.randint(2, 8), 2 * rng.randint(2, 8)) for _ in range(rng.randint(2, 8))]


CASES = {
    "fewer items than ranks": [(1, 8, 8)],
    "one huge item": [(1, 4, 4), (1, 24, 24), (2, 4, 8)],
    "videos": [(3, 8, 8), (1, 4, 12), (2, 4, 4), (1, 8, 4), (4, 4, 4)],
    "one long video, its frames over the ranks": [(4, 8, 8), (1, 4, 4)],
    "no items": [],
    **{f"random {seed}": _random_grid(seed) for seed in range(2)},
}
"""Grids (t, h, w) in patches."""


FAMILIES = {2: ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"] if THOROUGH else ["qwen2.5-vl", "qwen3-vl"], 3: ["qwen2.5-vl"]}
"""The towers each group runs (each traces once per process, some 3 s of CPU): 3 ranks run the window-ordered one;
Qwen2-VL (Qwen2.5-VL's layout without windows) in the thorough profile."""


def _towers_equal_single_process(group):
    for name in FAMILIES[dist.get_world_size(group)]:
        tower = compiled(name, group)
        for seed, (case, grid) in enumerate(CASES.items()):
            pixel_values, grid_thw = inputs(tower, grid, seed)
            with torch.no_grad():
                out, alone = tower(pixel_values, grid_thw), single(tower, pixel_values, grid_thw)
            assert type(out) is type(alone), (name, case)
            assert len(output_fields(out)) == len(output_fields(alone)) == (3 if name == "qwen3-vl" else 2)
            for mine, theirs in zip(output_fields(out), output_fields(alone)):
                assert mine.shape == theirs.shape, (name, case)
                torch.testing.assert_close(
                    mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, at=f"{name}, {case}": f"{at}: {m}"
                )
        assert tower.load_stats.calls == len(CASES)
        assert f"data parallel over {dist.get_world_size(group)} ranks" in tower.stats_table()


def _mismatched_batches_raise_on_every_rank(group):
    """Different item order on rank 0, then float64 pixels, then a numpy array, on the last rank only: every rank
    raises a ValueError before the gather (the last rank its own input error), and the group serves the next
    call."""
    tower = compiled("qwen2.5-vl", group)
    rank, last = dist.get_rank(group), dist.get_world_size(group) - 1
    grid = [(1, 8, 4), (1, 8, 8)]
    pixel_values, grid_thw = inputs(tower, grid if rank else grid[::-1], 0)
    with torch.no_grad(), pytest.raises(ValueError, match="were called with different grid_thw"):
        tower(pixel_values, grid_thw)
    pixel_values, grid_thw = inputs(tower, grid, 0)
    message = "is torch.float64 on cpu but the tower is torch.float32" if rank == last else "different grid_thw"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        tower(pixel_values.double() if rank == last else pixel_values, grid_thw)
    message = "must be a torch.Tensor, got ndarray" if rank == last else "different grid_thw"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        tower(pixel_values.numpy() if rank == last else pixel_values, grid_thw)
    with torch.no_grad():
        out, alone = tower(pixel_values, grid_thw), single(tower, pixel_values, grid_thw)
    torch.testing.assert_close(out.last_hidden_state, alone.last_hidden_state, rtol=1e-5, atol=1e-5)


def _vlm_greedy_tokens_equal_stock(group):
    """A whole tiny Qwen3-VL, two prompts with three photos and a video clip: compile_vlm over the group, data
    parallel, gives the stock logits and greedy tokens on every rank."""
    model = tiny_vlm(group)[0]
    with parallel(model.model.visual, "data"):
        calls = vlm_equals_stock(group)
    assert calls == {"data": calls["data"]} and calls["data"] >= 2  # images and video, data parallel


def _collectives_are_compared_across_ranks(group):
    """The group runs under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: an all-reduce whose shape differs by rank raises
    on every rank before it is issued (so a check that let ranks issue different collectives fails, not hangs),
    and the group serves the next collective."""
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    with pytest.raises(RuntimeError, match="Detected mismatch between collectives"):
        dist.all_reduce(torch.ones(1 + dist.get_rank(group)), group=group)
    total = torch.ones(2)
    dist.all_reduce(total, group=group)
    assert total.tolist() == [dist.get_world_size(group)] * 2


CHECKS = {
    2: [
        _collectives_are_compared_across_ranks,
        _towers_equal_single_process,
        _mismatched_batches_raise_on_every_rank,
        _vlm_greedy_tokens_equal_stock,
    ],
    3: [
        _collectives_are_compared_across_ranks,
        *([_towers_equal_single_process] if THOROUGH else []),
        _mismatched_batches_raise_on_every_rank,
    ],
}
"""The checks each group size runs. Three ranks' uneven shares are served in data mode by the sequence-parallel
``auto`` stream in every profile; the whole-batch comparison at three ranks runs with
``HYPOTHESIS_PROFILE=thorough``."""


test_passed_on_every_rank = passed_on_every_rank(CHECKS, apart=(_vlm_greedy_tokens_equal_stock,))


def test_vlm_greedy_tokens_equal_stock(gloo_group):
    pytest.importorskip("skimage", reason="the sample photographs come with scikit-image")
    assert_passed(gloo_group, _vlm_greedy_tokens_equal_stock, CHECKS)
