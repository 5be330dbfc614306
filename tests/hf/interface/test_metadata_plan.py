"""The metadata plan learned from one eager forward: the tower's ``get_*(..., kwargs)`` calls replayed on the host
for any grid, values passed from one call to the next, and the refusals that name what the tower does instead.
The towers here are tiny modules of this file: its ``get_*`` functions are the ones ``record_metadata`` wraps."""

import pytest
import torch
import torch.nn.functional as F

from vgraph_compile.hf.interface.metadata_plan import TowerRefused, record_metadata

PIXELS = torch.randn(3, 4)
GRID = torch.tensor([[1, 2, 4], [2, 2, 2]])


def get_cu_seqlens(grid_thw, kwargs=None):
    """transformers' form (``vision_utils.get_vision_cu_seqlens``): the precomputed value popped from ``kwargs``,
    else computed from the grid."""
    cu_seqlens = None if kwargs is None else kwargs.pop("cu_seqlens", None)
    if cu_seqlens is None:
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu_seqlens = F.pad(frames.cumsum(0), (1, 0)).to(torch.int32)
    return cu_seqlens


def get_max_seqlen(cu_seqlens, kwargs=None):
    max_seqlen = None if kwargs is None else kwargs.pop("max_seqlen", None)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if max_seqlen is None else max_seqlen


class PackedTower(torch.nn.Module):
    def forward(self, pixel_values, grid_thw, **kwargs):
        cu_seqlens = get_cu_seqlens(grid_thw.flip(0), kwargs)  # a torch op on the grid first
        return pixel_values * get_max_seqlen(cu_seqlens, kwargs) + cu_seqlens[-1]


class HostReadTower(torch.nn.Module):
    def forward(self, pixel_values, grid_thw, **kwargs):
        return pixel_values * len(grid_thw.tolist()) + get_cu_seqlens(grid_thw, kwargs)[-1]


class NoKwargsTower(torch.nn.Module):
    def forward(self, pixel_values, grid_thw):
        return pixel_values + get_cu_seqlens(grid_thw)[-1]


class PlainModule(torch.nn.Module):
    def forward(self, pixel_values, grid_thw):
        return pixel_values * 2


def test_the_plan_computes_for_any_grid_what_the_towers_functions_compute():
    plan, output = record_metadata(PackedTower(), PIXELS, "grid_thw", GRID)
    torch.testing.assert_close(output, PackedTower()(PIXELS, GRID))
    assert plan.keys == ("cu_seqlens", "max_seqlen")
    assert plan.describe() == "get_cu_seqlens -> cu_seqlens; get_max_seqlen -> max_seqlen"
    for grid in (torch.tensor([[1, 3, 3]]), torch.tensor([[3, 1, 2], [1, 4, 4], [1, 2, 2]])):
        values = plan.compute(grid)
        expected = get_cu_seqlens(grid.flip(0), {})
        assert torch.equal(values["cu_seqlens"], expected)
        assert values["max_seqlen"] == get_max_seqlen(expected, {})  # from this grid's cu_seqlens, not the probe's


def test_the_tower_served_with_the_planned_values_equals_its_own_computation():
    plan, _ = record_metadata(PackedTower(), PIXELS, "grid_thw", GRID)
    grid = torch.tensor([[2, 3, 1]])
    torch.testing.assert_close(PackedTower()(PIXELS, grid, **plan.compute(grid)), PackedTower()(PIXELS, grid))


def test_a_host_read_of_the_grid_outside_the_functions_is_refused():
    message = r"HostReadTower cannot be served by vgraph: it reads a grid-derived tensor on the host \(tolist\)"
    with pytest.raises(ValueError, match=message):
        record_metadata(HostReadTower(), PIXELS, "grid_thw", GRID)


def test_a_function_called_without_kwargs_is_refused_as_it_cannot_take_a_precomputed_value():
    message = "calls get_cu_seqlens without kwargs at .*cannot take its value precomputed"
    with pytest.raises(TowerRefused, match=message):
        record_metadata(NoKwargsTower(), PIXELS, "grid_thw", GRID)


def test_a_module_that_computes_no_grid_metadata_is_not_a_packed_tower():
    with pytest.raises(ValueError, match="PlainModule computes no grid metadata .*: not a packed tower"):
        record_metadata(PlainModule(), PIXELS, "grid_thw", GRID)


def test_the_functions_are_restored_after_recording():
    record_metadata(PackedTower(), PIXELS, "grid_thw", GRID)
    assert not hasattr(get_cu_seqlens, "__wrapped__")
    assert globals()["get_cu_seqlens"] is get_cu_seqlens
