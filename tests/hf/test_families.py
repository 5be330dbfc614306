"""Every transformers family whose vision tower uses ``transformers.vision_utils`` (found by reading the installed
transformers), as a tiny random tower built from its own config class: served by bucket graphs and equal to the
eager tower (same attention op, fp32 rel <= 1e-5) over an image, a video, a one-merge-unit image and a mixed,
split call; or refused with a ValueError that says why, before anything is compiled."""

import pytest
import torch

from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention
from vgraph_compile.models.hf_families import build_tower, vision_utils_families

SERVED = {
    "cohere_compass", "ernie4_5_vl_moe", "exaone4_5", "qwen2_5_omni", "qwen2_5_vl", "qwen2_vl", "qwen3_5",
    "qwen3_5_moe", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe", "qwen4_exp",
}
"""The families served today (README table); every other family must be refused, never served wrongly."""


def _assert_same(out, ref):
    assert type(out) is type(ref)
    for name, value in ref.items():
        mine = out[name]
        for a, b in zip(*(v if isinstance(v, (list, tuple)) else [v] for v in (mine, value))):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.fixture(autouse=True)
def _one_trace_per_family():
    """Every family traces the same wrapper forward once: dynamo's per-code recompile limit (8) would send the
    later families to eager."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.parametrize("name", sorted(vision_utils_families()))
def test_served_equal_to_eager_or_refused(name):
    try:
        tower = build_tower(name, tiny=True)
    except Exception as error:  # a config the shared tiny sizes cannot shrink
        pytest.skip(f"tiny config: {error}")
    if name not in SERVED:
        m = 2
        grid_thw = torch.tensor([(1, 4 * m, 6 * m)])
        before = counters.snapshot()["replays"]
        with pytest.raises(ValueError):  # at compile, or at the trace of the first call
            served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa")
            with torch.no_grad():
                served(torch.randn(int(grid_thw.prod()), *served.interface.pixel_shape), grid_thw)
        assert counters.snapshot()["replays"] == before
        return
    served = compile_vision_tower(
        tower, token_budgets=[256, 1024], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa"
    )
    m = served.geometry.spatial_merge_size
    cases = {
        "image": [(1, 4 * m, 6 * m)],
        "video": [(3, 2 * m, 4 * m)],
        "one merge unit": [(1, m, m)],
        "mixed": [(1, 4 * m, 6 * m), (2, 2 * m, 2 * m), (1, m, m)],
        "split": [(1, 4 * m, 4 * m), (1, 2 * m, 2 * m), (2, m, 2 * m), (1, m, m), (1, 2 * m, m)],  # 5 > max_items
    }
    for case, grid in cases.items():
        grid_thw = torch.tensor(grid)
        pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), *served.interface.pixel_shape)
        before = counters.snapshot()["replays"]
        with torch.no_grad():
            out = served(pixel_values, grid_thw)
            with routed_attention(tower):
                ref = tower(pixel_values, grid_thw)
        assert counters.snapshot()["replays"] > before, case  # graphs served it, not the eager tower
        _assert_same(out, ref)
