"""``VisionGeometry.bounds``: proven by brute force over generated grids, and tight (each bound reached)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import report
from vgraph_compile.geometry import VisionGeometry

GEOMETRIES = {
    "qwen2-vl": VisionGeometry(patch_size=14),
    "qwen2.5-vl": VisionGeometry(patch_size=14, window_size=112),
    "qwen3-vl": VisionGeometry(patch_size=16),
    "window-2": VisionGeometry(patch_size=14, window_size=56),
}
BUDGETS = (64, 256, 1024, 4096, 16384)


def measure(geometry: VisionGeometry, items: list[tuple[int, int, int]]) -> dict[str, int]:
    """Sizes of a packed call, by brute force: items are (t, h, w) in patches, as in grid_thw."""
    m, w = geometry.spatial_merge_size, geometry.merged_window
    frame_lengths = [h * wd for t, h, wd in items for _ in range(t)]
    windows, window_lengths = 0, [0]
    for t, h, wd in items:
        cells: dict[tuple[int, int], int] = {}
        for i in range(h // m):
            for j in range(wd // m):
                key = (i // w, j // w) if w else (0, 0)
                cells[key] = cells.get(key, 0) + m * m
        windows += t * len(cells) if w else 0
        window_lengths += list(cells.values()) if w else []
    return {
        "tokens": sum(frame_lengths),
        "merged_tokens": sum(frame_lengths) // (m * m),
        "segments": len(frame_lengths),
        "windows": windows,
        "max_seqlen_full": max(frame_lengths),
        "max_seqlen_window": max(window_lengths),
        "window_index": sum(frame_lengths) // (m * m),
    }


@st.composite
def calls(draw, geometry: VisionGeometry):
    """A call that fits a budget: 1-6 items, images and videos, strips and 1x1 merged grids."""
    m = geometry.spatial_merge_size
    budget = draw(st.sampled_from(BUDGETS))
    max_items = draw(st.integers(1, 6))
    max_frames = draw(st.integers(max_items, 4 * max_items))
    items, tokens, frames = [], 0, 0
    for _ in range(draw(st.integers(1, max_items))):
        t = draw(st.sampled_from([1, 1, 2, 4, 8]))
        side = draw(st.sampled_from(["square", "strip", "tall", "any"]))
        cap = max(1, math.isqrt(budget // (m * m * t)))
        a = 1 if side == "strip" else draw(st.integers(1, cap))
        b = 1 if side == "tall" else draw(st.integers(1, max(1, budget // (m * m * t * a))))
        if side == "square":
            b = a
        size = t * a * b * m * m
        if tokens + size > budget or frames + t > max_frames:
            break
        items.append((t, a * m, b * m))
        tokens, frames = tokens + size, frames + t
    if not items:
        items = [(1, m, m)]
    return budget, max_items, max_frames, items


@pytest.mark.parametrize("name", GEOMETRIES)
def test_no_grid_exceeds_a_bound(name):
    geometry = GEOMETRIES[name]

    @given(call=calls(geometry))
    def check(call):
        budget, max_items, max_frames, items = call
        bounds = geometry.bounds(budget, max_items, max_frames).as_dict()
        for key, value in measure(geometry, items).items():
            assert value <= bounds[key], f"{key}: {value} > bound {bounds[key]} for {items} (budget {budget})"

    check()


def witnesses(geometry: VisionGeometry, budget: int, max_frames: int) -> dict[str, list[tuple[int, int, int]]]:
    """Calls built to reach each bound: one strip filling the budget, m x m frames, 1-token frames and a strip."""
    m, w = geometry.spatial_merge_size, geometry.merged_window or 1
    merged = budget // (m * m)
    many = min(max_frames, merged)
    # windows: F - 1 frames of one merged token, then one strip of 1 + w k tokens (k + 1 windows)
    frames = min(max_frames, merged)
    strip = 1 + w * ((merged - frames) // w)
    strips = [(1, m, m)] * (frames - 1) + [(1, m, strip * m)]
    return {
        "tokens": [(1, m, merged * m)],
        "merged_tokens": [(1, m, merged * m)],
        "segments": [(1, m, m)] * many,
        "windows": strips,
        "max_seqlen_full": [(1, m, merged * m)],
        "max_seqlen_window": [(1, min(w, merged) * m, min(w, merged) * m)],
        "window_index": [(1, m, merged * m)],
    }


def witness_slacks(geometry: VisionGeometry):
    """``(budget, max_frames, key, bound, reached, items)`` for every bound and its witness call, over the budgets
    and 1, 8 and 64 frames."""
    for budget in BUDGETS:
        for max_frames in (1, 8, 64):
            bounds = geometry.bounds(budget, 1, max_frames).as_dict()
            for key, items in witnesses(geometry, budget, max_frames).items():
                reached = measure(geometry, items)
                assert reached["tokens"] <= budget and len(items) <= max_frames, f"witness {items[:3]} is no call"
                yield budget, max_frames, key, bounds[key], reached[key], items


@pytest.mark.parametrize("name", GEOMETRIES)
def test_every_bound_is_reached_exactly(name):
    """For every budget, a real call (its witness) reaches each bound: no bound is loose."""
    for budget, max_frames, key, bound, reached, items in witness_slacks(GEOMETRIES[name]):
        assert reached == bound, f"{key} bound {bound} not reached ({reached}) by {items[:3]} (budget {budget})"


@pytest.mark.parametrize("name", GEOMETRIES)
def test_slack_is_never_negative_and_reported(name):
    """No witness exceeds its bound; the worst slack (bound - reached) per size and, for windows, the sizes that
    vLLM's S + ceil(T/w) and the token budget would give, go to the report."""
    geometry = GEOMETRIES[name]
    worst: dict[str, int] = {}
    for budget, max_frames, key, bound, reached, items in witness_slacks(geometry):
        assert reached <= bound, f"{key}: {reached} > bound {bound} for {items[:3]} (budget {budget})"
        worst[key] = max(worst.get(key, 0), bound - reached)
    report(f"{name}: worst slack over budgets {BUDGETS} x frames (1, 8, 64): {worst}")
    if geometry.window_size:
        budget, w = 4096, geometry.merged_window
        windows = geometry.bounds(budget, 1, 8).windows
        report(
            f"{name} budget {budget}, 8 frames: windows bound {windows}; "
            f"vLLM S + ceil(T/w) = {8 + math.ceil(budget // 4 / w)}; token budget = {budget}"
        )


def test_invalid_geometry_and_budget():
    with pytest.raises(ValueError, match="not a multiple of patch_size x spatial_merge_size = 28"):
        VisionGeometry(patch_size=14, window_size=100)
    with pytest.raises(ValueError, match="holds no frame"):
        VisionGeometry(patch_size=14).bounds(3, 1)
    with pytest.raises(ValueError, match="every item has a frame"):
        VisionGeometry(patch_size=14).bounds(64, 4, 2)
