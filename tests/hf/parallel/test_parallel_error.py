"""The error of a call over several ranks against the same call on one rank (``hf/parallel/parallel_error``), in groups of 2
gloo processes on a toy Qwen2.5-VL tower (windows, a window permutation) in float32 and bfloat16: in every mode
(data, sequence, both in one call) the relative error per call is within ``ERROR_BOUND_FACTOR`` times one rank's
own error against the float64 stock tower; data parallel with each item alone on its rank is bitwise equal to
each item alone on one rank.

The groups (``tests/hf/gloo_group.py``) run the checks of ``CHECKS``.
"""

import torch

from tests.hf.gloo_group import compiled, inputs, parallel, passed_on_every_rank, single
from vgraph_compile.hf.parallel.parallel_error import ERROR_BOUND_FACTOR, Float64Reference, output_fields, relative_error

MODES = {
    "data": [[(1, 8, 8), (1, 8, 12), (1, 16, 8)], [(2, 8, 8), (1, 4, 4)]],
    "sequence": [[(1, 16, 24)], [(1, 8, 12), (2, 16, 8), (1, 4, 4)]],
    "auto": [[(1, 16, 24), (1, 4, 4)], [(1, 8, 8)] * 4],
}
"""Grids (t, h, w) in patches per mode asked; ``auto`` serves one call data and one sequence+data parallel."""


def _within_bound(dtype: torch.dtype):
    def check(group):
        tower = compiled("qwen2.5-vl", group, dtype)
        reference = Float64Reference(tower.tower)
        served = set()
        for mode, grids in MODES.items():
            with parallel(tower, mode) as calls, torch.no_grad():
                for seed, grid in enumerate(grids):
                    pixel_values, grid_thw = inputs(tower, grid, seed)
                    out, alone = tower(pixel_values, grid_thw), single(tower, pixel_values, grid_thw)
                    error = relative_error(output_fields(out), output_fields(alone))
                    own = relative_error(output_fields(alone), reference(pixel_values, grid_thw))
                    assert 0 < own < (0.05 if dtype == torch.bfloat16 else 1e-5), (mode, grid, own)
                    assert error <= ERROR_BOUND_FACTOR * own, (mode, grid, error, own)
            served |= set(calls)
        assert served == {"data", "sequence", "sequence+data"}, served

    check.__name__ = f"_within_bound_{str(dtype).removeprefix('torch.')}"
    return check


_within_bound_float32 = _within_bound(torch.float32)
_within_bound_bfloat16 = _within_bound(torch.bfloat16)


def _data_items_alone_are_bitwise_equal(group):
    """Two items on two ranks, data parallel, each alone on its rank: every field's rows bitwise equal to the item
    alone on one rank (the same compiled code on the same layout; the gather only moves them), in both dtypes."""
    for dtype in (torch.float32, torch.bfloat16):
        tower = compiled("qwen2.5-vl", group, dtype)
        grid = [(1, 8, 12), (1, 8, 8)]
        pixel_values, grid_thw = inputs(tower, grid, 0)
        with parallel(tower, "data"), torch.no_grad():
            out = output_fields(tower(pixel_values, grid_thw))
            first = grid[0][0] * grid[0][1] * grid[0][2]
            items = [
                output_fields(single(tower, rows, torch.tensor([item])))
                for rows, item in zip((pixel_values[:first], pixel_values[first:]), grid)
            ]
        for index, field in enumerate(out):
            assert torch.equal(field, torch.cat([item[index] for item in items])), (dtype, index)


CHECKS = {2: [_within_bound_float32, _within_bound_bfloat16, _data_items_alone_are_bitwise_equal]}


test_passed_on_every_rank = passed_on_every_rank(CHECKS)
