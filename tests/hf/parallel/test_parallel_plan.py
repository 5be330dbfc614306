"""The per-call plan of ``parallel="auto"`` (``hf/parallel/parallel_plan``) as a pure function (hypothesis): every item
encoded exactly once, by rows or by a single rank; never costlier than either pure mode; the items split by rows
are the largest; the same plan from the same grid (what every rank computes on its own)."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.parallel.parallel_plan import plan, plan_cost, split_frames
from vgraph_compile.hf.parallel.sequence_parallel import split_rows

PLAIN = VisionGeometry(patch_size=16, spatial_merge_size=2)
rows = st.tuples(st.integers(1, 3), st.sampled_from([2, 4, 8, 12, 16]), st.sampled_from([2, 4, 8, 16]))


def _slice_rows(ranks: int):
    return lambda grid: split_rows(tuple(grid), PLAIN, ranks, 4).slice_rows


@given(grid=st.lists(rows, max_size=8), ranks=st.integers(1, 5), sequence_cost=st.sampled_from([1.0, 1.2, 2.0]))
def test_every_item_once_never_worse_than_a_pure_mode(grid, ranks, sequence_cost):
    slice_rows = _slice_rows(ranks)
    chosen = plan(grid, ranks, slice_rows, sequence_cost)
    sizes = [t * h * w for t, h, w in grid]
    data_shares = [chosen.data[i] for share in chosen.assignment.items for i in share]
    assert sorted([*chosen.sequence, *data_shares]) == list(range(len(grid)))
    assert sorted(chosen.data) == list(chosen.data) and not set(chosen.data) & set(chosen.sequence)
    everything = tuple(range(len(grid)))
    for pure in ((), everything) if ranks > 1 else ((),):
        assert chosen.cost <= plan_cost(grid, pure, ranks, slice_rows, sequence_cost)[0]
    if chosen.sequence and chosen.data:  # the largest items go by rows
        assert min(sizes[i] for i in chosen.sequence) >= max(sizes[i] for i in chosen.data)
    assert plan(list(grid), ranks, _slice_rows(ranks), sequence_cost) == chosen  # from the grid alone


def _optimum(sizes: list[int], ranks: int) -> int:
    """The smallest most-loaded rank over every placement of whole items (brute force)."""
    best = sum(sizes)
    for placement in itertools.product(range(ranks), repeat=len(sizes)):
        loads = [0] * ranks
        for size, rank in zip(sizes, placement):
            loads[rank] += size
        best = min(best, max(loads))
    return best


@given(grid=st.lists(rows, min_size=1, max_size=7), ranks=st.integers(2, 3))
def test_data_share_within_the_greedy_bound_of_the_optimum(grid, ranks):
    """The data-parallel part's most loaded rank is within (4/3 - 1/(3 ranks)) of the best placement of those
    items (largest-first greedy's bound, Graham 1969)."""
    chosen = plan(grid, ranks, _slice_rows(ranks), 1.2)
    if chosen.data:
        sizes = [grid[i][0] * grid[i][1] * grid[i][2] for i in chosen.data]
        assert max(chosen.assignment.loads) <= (4 / 3 - 1 / (3 * ranks)) * _optimum(sizes, ranks) + 1e-9


def test_examples():
    """One image of 64 x 64 patches between two of 16 x 16 on 2 ranks: the large one by rows (slices of 2048 rows
    at 1.2 = 2457.6, plus 256 for a small one on each rank), not all by items (4096: one rank holds the large one)
    nor all by rows (slices of 2304 rows, 2764.8). Four equal images: all by items. One image alone: by rows; on
    one rank, by items."""
    slice_rows = _slice_rows(2)
    mixed = plan([(1, 16, 16), (1, 64, 64), (1, 16, 16)], 2, slice_rows, 1.2)
    assert (mixed.sequence, mixed.data, mixed.mode) == ((1,), (0, 2), "sequence+data")
    assert mixed.assignment.items == ((0,), (1,))
    assert mixed.cost == pytest.approx(2048 * 1.2 + 256)
    assert plan([(1, 32, 32)] * 4, 2, slice_rows, 1.2).mode == "data"
    alone = plan([(1, 64, 64)], 2, slice_rows, 1.2)
    assert (alone.sequence, alone.data, alone.mode) == ((0,), (), "sequence")
    assert plan([(1, 64, 64)], 1, _slice_rows(1), 1.2).mode == "data"


@given(grid=st.lists(rows, max_size=9), ranks=st.integers(1, 5))
def test_split_frames_keeps_the_rows_in_order(grid, ranks):
    """Each item becomes consecutive items of its frames (the same rows in the same order); only a video over a
    rank's fair share is cut, into min(t, ranks) parts that differ by a frame at most."""
    split = split_frames(grid, ranks)
    total = sum(t * h * w for t, h, w in grid)
    position = 0
    for t, h, w in grid:
        parts = min(t, ranks) if t * h * w * ranks > total else 1
        pieces = split[position : position + parts]
        assert all((ph, pw) == (h, w) for _, ph, pw in pieces) and sum(pt for pt, _, _ in pieces) == t
        assert max(pt for pt, _, _ in pieces) - min(pt for pt, _, _ in pieces) <= 1
        position += parts
    assert position == len(split)


def test_split_frames_example():
    """A 5-frame video of 256 patches a frame beside one 16-patch image, 3 ranks: 2 + 2 + 1 frames."""
    assert split_frames([(5, 16, 16), (1, 4, 4)], 3) == ((2, 16, 16), (2, 16, 16), (1, 16, 16), (1, 4, 4))
