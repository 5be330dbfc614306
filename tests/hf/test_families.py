"""Every transformers family whose vision tower uses ``transformers.vision_utils`` (found by reading the installed
transformers), as a tiny random tower built from its own config class: served by bucket graphs and equal to the
eager tower (same attention op, fp32 rel <= 1e-5) over an image, a video, a one-merge-unit image and a mixed,
split call; a tower whose stock forward fails on videos is served on images and refuses a video per call. The
families served by a lower tier are tested with it."""

import pytest
import torch

from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention
from vgraph_compile.sample_models.vision_utils_towers import build_tower, vision_utils_families
from tests.hf.blocks import test_block_graphs
from tests.hf.exact_size import test_exact_size_tower

LOWER_TIERS = {*test_block_graphs.SERVED, *test_exact_size_tower.FIXED_TILES}
"""Families the whole-tower graph refuses, served by block graphs (``test_block_graphs``) or by the exact-size code
(``test_exact_size_tower``), and tested there."""
IMAGES_ONLY = {"kimi_k25", "glm4v", "glm4v_moe", "glm_image"}
"""Families served on images whose stock tower fails on (or does not scale with) more than one frame (the GLM-4.1V
towers index the grid per frame: their models pass videos one frame per grid row)."""
GRID_TRACED = {"glm4v", "glm4v_moe", "glm_image"}
"""Families whose tower reads its grid as a device tensor outside its metadata functions (a per-image position
resize): the trace takes the grid as a padded table."""
BATCHED = {"paddleocr_vl"}
"""Families whose pixel_values carry a leading batch dim of 1."""


def _assert_same(out, ref):
    assert type(out) is type(ref)
    for name, value in ref.items():
        mine = out[name]
        for a, b in zip(*(v if isinstance(v, (list, tuple)) else [v] for v in (mine, value))):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("name", sorted(set(vision_utils_families()) - LOWER_TIERS))
def test_served_equal_to_eager(name):
    """Two calls on one trace: an image, a video (a frame-per-row image on image-only towers) and a
    one-merge-unit image in one graph call; then five items, more than ``max_items``, split over graph calls."""
    tower = build_tower(name, tiny=True)
    served = compile_vision_tower(tower, token_budgets=[256], max_items=3, compiler="eager", attention_backend="sdpa")
    assert (served.interface.video_failure is not None) == (name in IMAGES_ONLY)
    assert served.interface.grid_traced == (name in GRID_TRACED)
    assert served.interface.batched == (name in BATCHED)
    m = served.geometry.spatial_merge_size
    t = 1 if name in IMAGES_ONLY else 2
    if name in IMAGES_ONLY:
        refusal = r"grid_thw\[1\] = \(3, .* has 3 frames, but .* images only"
        with torch.no_grad(), pytest.raises(ValueError, match=refusal):
            served(torch.randn(served.interface.pixel_values_shape(4 * m * m)), torch.tensor([(1, m, m), (3, m, m)]))
    cases = {
        "one graph call": [(1, 4 * m, 6 * m), (t, 2 * m, 2 * m), (1, m, m)],
        "split": [(1, 4 * m, 4 * m), (1, 2 * m, 2 * m), (t, m, 2 * m), (1, m, m), (1, 2 * m, m)],
    }
    for case, grid in cases.items():
        grid_thw = torch.tensor(grid)
        pixel_values = torch.randn(served.interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
        before = counters.snapshot()["replays"], served.split_calls
        with torch.no_grad():
            out = served(pixel_values, grid_thw)
            with routed_attention(tower):
                ref = tower(pixel_values, grid_thw)
        assert counters.snapshot()["replays"] > before[0], case  # graphs served it, not the eager tower
        assert served.split_calls - before[1] == (case == "split"), case
        _assert_same(out, ref)
