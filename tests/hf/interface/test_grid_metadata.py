"""The grid metadata cache: each grid's keywords are the learned plan's, computed once per (grid, device), the
least recently used entry dropped past the cache size, and a sequence-parallel rank's share taken by ``localize``.
The grid table of a tower that reads its grid itself is in ``test_packed_tower.py``."""

import pytest
import torch

from vgraph_compile.hf.attention import ATTENTION_NAME, routed_attention
from vgraph_compile.hf.interface.grid_metadata import GridMetadata, grid_of
from vgraph_compile.hf.interface.packed_tower import learn_packed_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower

ONE, TWO, THREE = ((1, 2, 4),), ((1, 2, 2), (1, 4, 4)), ((2, 2, 2),)


@pytest.fixture(scope="module")
def tower_and_interface():
    tower = build_tower("qwen2_vl", tiny=True)
    return tower, learn_packed_tower(tower)


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_grid_of_reads_grid_thw_as_hashable_rows():
    assert grid_of(torch.tensor([[1, 2, 4], [1, 2, 2]])) == ((1, 2, 4), (1, 2, 2))


def test_an_entry_is_the_plans_values_for_that_grid_computed_once(tower_and_interface):
    tower, interface = tower_and_interface
    metadata = GridMetadata(tower, interface)
    entry = metadata(TWO, "cpu")
    with routed_attention(tower):  # as in the trace: get_max_seqlen reads the attention implementation
        expected = interface.metadata.compute(torch.tensor(TWO))
    assert entry.keys() == expected.keys() == set(interface.metadata.keys)
    assert all(_equal(entry[name], expected[name]) for name in expected)
    assert metadata(TWO, torch.device("cpu")) is entry
    assert tower.config._attn_implementation != ATTENTION_NAME  # the routing ends with the computation


def test_the_least_recently_used_grid_goes_first(tower_and_interface):
    metadata = GridMetadata(*tower_and_interface, size=2)
    one, two = metadata(ONE, "cpu"), metadata(TWO, "cpu")
    assert metadata(ONE, "cpu") is one  # ONE is now the most recently used
    metadata(THREE, "cpu")
    assert metadata(ONE, "cpu") is one and metadata(TWO, "cpu") is not two


def test_localize_takes_each_entry_before_it_is_cached(tower_and_interface):
    seen = []

    def first_half(grid, values):
        seen.append(grid)
        return {**values, "position_ids": values["position_ids"][: len(values["position_ids"]) // 2]}

    metadata = GridMetadata(*tower_and_interface, localize=first_half)
    entry = metadata(ONE, "cpu")
    metadata(ONE, "cpu")
    assert seen == [ONE]
    with routed_attention(tower_and_interface[0]):
        full = tower_and_interface[1].metadata.compute(torch.tensor(ONE))["position_ids"]
    assert torch.equal(entry["position_ids"], full[: len(full) // 2])


def test_threads_sharing_a_small_cache_each_get_their_grids_entry(tower_and_interface):
    """Eight threads over more grids than the cache holds (each evicting another's entries), switching as often as
    the interpreter can: every call returns its own grid's keywords, and none raises."""
    import concurrent.futures
    import sys

    tower, interface = tower_and_interface
    metadata = GridMetadata(tower, interface, size=2)
    grids = [((1, 2, 2 * width),) for width in range(1, 7)]
    with routed_attention(tower):
        expected = {grid: interface.metadata.compute(torch.tensor(grid)) for grid in grids}

    def run(offset):
        entries = [(grid, metadata(grid, "cpu")) for _ in range(40) for grid in grids[offset:] + grids[:offset]]
        return all(_equal(entry[name], expected[grid][name]) for grid, entry in entries for name in expected[grid])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert all(pool.map(run, range(8)))
    finally:
        sys.setswitchinterval(interval)
