"""Sequence-parallel encoding: the split as a pure function (hypothesis), and groups of 2 and 3 gloo processes on
toy Qwen2.5-VL (windows, a window permutation) and Qwen3-VL (deepstack) towers and a whole tiny Qwen3-VL: every
rank's output equal to the stock tower's, greedy tokens equal to the stock model's, one image split across the
ranks, a rank with an empty slice, 3 ranks over 2 heads (heads padded), ``parallel="auto"`` counting its choices,
and mismatched batches raising on every rank.

Each group is spawned once (module fixture) and runs every check in turn; each rank writes what each check gave
(``ok`` or the traceback) to a file, and the tests read them (as ``test_data_parallel``).
"""

import collections
import datetime
import functools
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.sequence_parallel import Split, choose, split_rows

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


def test_auto_chooses_sequence_when_one_item_dominates():
    one = [(1, 64, 64)]
    assert choose(one, split_rows(tuple(one), PLAIN, 2, 4)) == "sequence"
    even = [(1, 32, 32)] * 4
    assert choose(even, split_rows(tuple(even), PLAIN, 2, 4)) == "data"


# -- groups of processes ------------------------------------------------------------------------------------------
OPTIONS = dict(token_budgets=[64, 256], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa")
"""Small buckets: a rank's slice over 256 patches runs its trace eagerly (on every rank alike)."""

CASES = {
    "one image across the ranks": [(1, 16, 24)],
    "one band: the last rank empty": [(1, 8, 8)],
    "images and a video": [(1, 8, 12), (2, 16, 8), (1, 4, 4)],
    "over the largest bucket": [(1, 24, 32)],
}
"""Grids (t, h, w) in patches; bands of whole Qwen2.5-VL windows are 8 patch rows."""

FAMILIES = {2: ["qwen2.5-vl", "qwen3-vl"], 3: ["qwen2.5-vl"]}
"""Each tower traces once per process; 3 ranks over the toy's 2 heads pad them to 3."""


@functools.cache
def _compiled(name: str, group):
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.models.qwen_towers import TOY_SIZES, qwen_tower

    tower = qwen_tower(name, "cpu", torch.float32, **TOY_SIZES[name])
    return compile_vision_tower(tower, process_group=group, parallel="sequence", **OPTIONS)


def _inputs(tower, grid, seed):
    (width,) = tower.interface.pixel_shape
    patches = sum(t * h * w for t, h, w in grid)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(patches, width, generator=generator), torch.tensor(grid, dtype=torch.int64).view(-1, 3)


def _fields(out):
    return [out.pooler_output, out.last_hidden_state, *(getattr(out, "deepstack_features", None) or ())]


def _towers_equal_stock(group):
    """Every field equal to the stock tower (sdpa attention, eager), NaN never passing; the sequence graphs served
    (not the single-process ones)."""
    for name in FAMILIES[dist.get_world_size(group)]:
        tower = _compiled(name, group)
        for seed, (case, grid) in enumerate(CASES.items()):
            pixel_values, grid_thw = _inputs(tower, grid, seed)
            with torch.no_grad():
                out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
            for mine, theirs in zip(_fields(out), _fields(stock), strict=True):
                assert not mine.isnan().any(), (name, case)
                torch.testing.assert_close(
                    mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, at=f"{name}, {case}": f"{at}: {m}"
                )
        assert tower.parallel_calls == {"sequence": len(CASES)}
        assert not tower.runtimes  # the single-process trace never ran
        (runtime,) = tower.sequence_graphs.compiled.vgraph.runtimes
        ranks, largest = dist.get_world_size(group), OPTIONS["token_budgets"][-1]
        held = sum(tower._row_split(tuple(grid), ranks).slice_rows <= largest for grid in CASES.values())
        assert runtime.hits == 1 + held  # the warm-up, and every case whose slice a bucket holds (the rest eagerly)
        assert "sequence parallel:" in tower.stats_table()


def _auto_counts_choices_and_mismatch_raises(group):
    """auto: one dominant image goes sequence parallel, four equal ones data parallel, each counted; then item order
    differing on rank 0 raises on every rank, and the group serves the next call."""
    tower = _compiled("qwen2.5-vl", group)
    tower.parallel, tower.parallel_calls = "auto", collections.Counter()
    rank = dist.get_rank(group)
    with torch.no_grad():
        for grid in ([(1, 16, 24)], [(1, 8, 8)] * 4):
            pixel_values, grid_thw = _inputs(tower, grid, 0)
            out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
            torch.testing.assert_close(out.pooler_output, stock.pooler_output, rtol=1e-5, atol=1e-5)
        assert tower.parallel_calls == {"sequence": 1, "data": 1}
        grid = [(1, 8, 4), (1, 16, 16)]
        pixel_values, grid_thw = _inputs(tower, grid if rank else grid[::-1], 0)
        with pytest.raises(ValueError, match="were called with different grid_thw"):
            tower(pixel_values, grid_thw)
        pixel_values, grid_thw = _inputs(tower, grid, 0)
        out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
        torch.testing.assert_close(out.pooler_output, stock.pooler_output, rtol=1e-5, atol=1e-5)


def _vlm_greedy_tokens_equal_stock(group):
    """A whole tiny Qwen3-VL, a photo and a video clip: compile_vlm, sequence parallel over the group, gives the
    stock logits and greedy tokens on every rank."""
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
    requests = [Request((Item("image", photo["coffee"]), Item("video", clip)), (7, 3, 2), seed=1)]
    inputs = model_inputs(model, requests, image_processor(model.config, max_patches=128))
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    compile_vlm(model, process_group=group, parallel="sequence", **{**OPTIONS, "max_items": 4})
    with torch.no_grad():
        mine = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    tower = model.model.visual
    assert tower.parallel_calls["sequence"] >= 2 and tower.stock_calls == 0  # the images and the video, sequence parallel
    torch.testing.assert_close(mine, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())
    assert torch.equal(generated, tokens)


CHECKS = {
    2: [_towers_equal_stock, _auto_counts_choices_and_mismatch_raises, _vlm_greedy_tokens_equal_stock],
    3: [_towers_equal_stock],
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
    directory = tmp_path_factory.mktemp(f"sequence{ranks}")
    torch.multiprocessing.spawn(_rank, args=(ranks, str(directory)), nprocs=ranks)
    return ranks, [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _check(group_results, check) -> None:
    ranks, results = group_results
    if check not in CHECKS[ranks]:
        pytest.skip(f"not run in the group of {ranks}")
    for rank, result in enumerate(results):
        assert result[check.__name__] == "ok", f"rank {rank} of {ranks}:\n{result[check.__name__]}"


def test_towers_equal_stock(group_results):
    _check(group_results, _towers_equal_stock)


def test_auto_counts_choices_and_mismatch_raises(group_results):
    _check(group_results, _auto_counts_choices_and_mismatch_raises)


def test_vlm_greedy_tokens_equal_stock(group_results):
    pytest.importorskip("skimage", reason="the sample photographs come with scikit-image")
    _check(group_results, _vlm_greedy_tokens_equal_stock)
