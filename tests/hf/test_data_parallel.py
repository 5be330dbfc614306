"""Data-parallel encoding: the assignment as a pure function (hypothesis), and groups of 2 and 3 gloo processes on
toy Qwen2-VL / 2.5-VL / 3-VL towers and a whole tiny Qwen3-VL: every rank's output equal to a single-process call
(every field, Qwen2.5-VL's window-permuted last_hidden_state and Qwen3-VL's deepstack features included), greedy
tokens equal to the stock model's, and mismatched batches raising on every rank.

Each group is spawned once (module fixture) and runs every check in turn; each rank writes what each check
gave (``ok`` or the traceback) to a file, and the tests read them. The single-process call is the same compiled
tower with ``process_group=None``: the same graphs, no collective.
"""

import datetime
import functools
import json
import os
import random
import traceback

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.hf.data_parallel import Assignment, LoadStats, assign, grid_hash

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


def test_grid_hash_tells_order_and_frames_apart():
    hashes = {grid_hash(g) for g in ([(1, 8, 4), (1, 8, 8)], [(1, 8, 8), (1, 8, 4)], [(2, 8, 4), (1, 8, 8)], [])}
    assert len(hashes) == 4 and all(0 <= h < 2**62 for h in hashes)


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


# -- groups of processes ------------------------------------------------------------------------------------------
OPTIONS = dict(token_budgets=[64, 256], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa")
"""Small buckets: over 3 items, 6 frames or 256 patches split a rank's share; a 24x24 image (576 patches) runs
eagerly."""


def _random_grid(seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([1, 1, 2]), 2 * rng.randint(2, 8), 2 * rng.randint(2, 8)) for _ in range(rng.randint(2, 8))]


CASES = {
    "fewer items than ranks": [(1, 8, 8)],
    "one huge item": [(1, 4, 4), (1, 24, 24), (2, 4, 8)],
    "videos": [(3, 8, 8), (1, 4, 12), (2, 4, 4), (1, 8, 4), (4, 4, 4)],
    "no items": [],
    **{f"random {seed}": _random_grid(seed) for seed in range(2)},
}
"""Grids (t, h, w) in patches."""


def _inputs(tower, grid, seed):
    (width,) = tower.interface.pixel_shape
    patches = sum(t * h * w for t, h, w in grid)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(patches, width, generator=generator), torch.tensor(grid, dtype=torch.int64).view(-1, 3)


def _fields(out):
    return [out.pooler_output, out.last_hidden_state, *(getattr(out, "deepstack_features", None) or ())]


FAMILIES = {2: ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"], 3: ["qwen2.5-vl"]}
"""The towers each group runs (each traces once per process, some 3 s of CPU): 3 ranks run the window-ordered one."""


@functools.cache
def _compiled(name: str, group):
    from tests.hf.conftest import TOY_SIZES
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.models.qwen_towers import qwen_tower

    return compile_vision_tower(
        qwen_tower(name, "cpu", torch.float32, **TOY_SIZES[name]), process_group=group, **OPTIONS
    )


def _single(tower, pixel_values, grid_thw):
    """The single-process call: the same graphs, no collective."""
    group, tower.process_group = tower.process_group, None
    try:
        return tower(pixel_values, grid_thw)
    finally:
        tower.process_group = group


def _towers_equal_single_process(group):
    for name in FAMILIES[dist.get_world_size(group)]:
        tower = _compiled(name, group)
        for seed, (case, grid) in enumerate(CASES.items()):
            pixel_values, grid_thw = _inputs(tower, grid, seed)
            with torch.no_grad():
                out, single = tower(pixel_values, grid_thw), _single(tower, pixel_values, grid_thw)
            assert type(out) is type(single), (name, case)
            assert len(_fields(out)) == len(_fields(single)) == (3 if name == "qwen3-vl" else 2)
            for mine, theirs in zip(_fields(out), _fields(single)):
                assert mine.shape == theirs.shape, (name, case)
                torch.testing.assert_close(
                    mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, at=f"{name}, {case}": f"{at}: {m}"
                )
        assert tower.load_stats.calls == len(CASES)
        assert f"data parallel over {dist.get_world_size(group)} ranks" in tower.stats_table()


def _mismatched_batches_raise_on_every_rank(group):
    """Different item order on rank 0, then float64 pixels on the last rank only: every rank raises a ValueError
    before the gather (the last rank its own input error), and the group serves the next call."""
    tower = _compiled("qwen2.5-vl", group)
    rank, last = dist.get_rank(group), dist.get_world_size(group) - 1
    grid = [(1, 8, 4), (1, 8, 8)]
    pixel_values, grid_thw = _inputs(tower, grid if rank else grid[::-1], 0)
    with torch.no_grad(), pytest.raises(ValueError, match="were called with different grid_thw"):
        tower(pixel_values, grid_thw)
    pixel_values, grid_thw = _inputs(tower, grid, 0)
    message = "is torch.float64 on cpu but the tower is torch.float32" if rank == last else "different grid_thw"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        tower(pixel_values.double() if rank == last else pixel_values, grid_thw)
    with torch.no_grad():
        out, single = tower(pixel_values, grid_thw), _single(tower, pixel_values, grid_thw)
    torch.testing.assert_close(out.last_hidden_state, single.last_hidden_state, rtol=1e-5, atol=1e-5)


def _vlm_greedy_tokens_equal_stock(group):
    """A whole tiny Qwen3-VL (deepstack features feed the language model), two prompts with three photos and a
    video clip: compile_vlm over the group gives the stock logits and greedy tokens on every rank."""
    from vgraph_compile.hf import compile_vlm
    from vgraph_compile.models.qwen_vlms import (
        Item,
        Request,
        image_processor,
        model_inputs,
        photos,
        qwen_vlm,
        video_clip,
    )

    model = qwen_vlm("qwen3-vl")
    photo = photos()
    clip = video_clip(photo["astronaut"], frames=4, size=(112, 112), step=16)
    requests = [
        Request((Item("image", photo["coffee"]), Item("video", clip)), (7, 3, 2), seed=1),
        Request((Item("image", photo["chelsea"], (150, 220)), Item("image", photo["rocket"])), (4, 2, 9), seed=2),
    ]
    inputs = model_inputs(model, requests, image_processor(model.config, max_patches=128))
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    compile_vlm(model, process_group=group, **{**OPTIONS, "max_items": 4})
    with torch.no_grad():
        mine = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    tower = model.model.visual
    assert tower.load_stats.calls >= 2 and tower.stock_calls == 0  # images and video, data parallel
    torch.testing.assert_close(mine, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())
    assert torch.equal(generated, tokens)


CHECKS = {
    2: [_towers_equal_single_process, _mismatched_batches_raise_on_every_rank, _vlm_greedy_tokens_equal_stock],
    3: [_towers_equal_single_process, _mismatched_batches_raise_on_every_rank],
}


def _rank(rank: int, ranks: int, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/init",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=60),
    )
    results = {}
    try:
        for check in CHECKS[ranks]:
            try:
                check(dist.group.WORLD)
                results[check.__name__] = "ok"
            except Exception:
                results[check.__name__] = traceback.format_exc()
    finally:
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=sorted(CHECKS))
def group_results(request, tmp_path_factory):
    """(ranks, one {check: "ok" or traceback} per rank) from one spawned group of gloo processes."""
    ranks = request.param
    directory = tmp_path_factory.mktemp(f"gloo{ranks}")
    torch.multiprocessing.spawn(_rank, args=(ranks, str(directory)), nprocs=ranks)
    return ranks, [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _check(group_results, check) -> None:
    ranks, results = group_results
    if check not in CHECKS[ranks]:
        pytest.skip(f"not run in the group of {ranks}")
    for rank, result in enumerate(results):
        assert result[check.__name__] == "ok", f"rank {rank} of {ranks}:\n{result[check.__name__]}"


def test_towers_equal_single_process(group_results):
    _check(group_results, _towers_equal_single_process)


def test_mismatched_batches_raise_on_every_rank(group_results):
    _check(group_results, _mismatched_batches_raise_on_every_rank)


def test_vlm_greedy_tokens_equal_stock(group_results):
    pytest.importorskip("skimage", reason="the sample photographs come with scikit-image")
    _check(group_results, _vlm_greedy_tokens_equal_stock)
