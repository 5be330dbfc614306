from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.hf.whole_graph.batching import pack

items = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=12)


@given(grid=items, budget=st.integers(16, 128), max_items=st.integers(1, 4), max_frames=st.integers(4, 8))
def test_every_item_once_and_batches_within_limits(grid, budget, max_items, max_frames):
    batches = pack(grid, budget, max_items, max_frames)
    assert sorted(i for batch in batches for i in batch.items) == list(range(len(grid)))
    for batch in batches:
        sizes = [grid[i][0] * grid[i][1] * grid[i][2] for i in batch.items]
        if batch.eager:
            assert len(batch.items) == 1 and (sizes[0] > budget or grid[batch.items[0]][0] > max_frames)
        else:
            assert sum(sizes) <= budget and len(batch.items) <= max_items
            assert sum(grid[i][0] for i in batch.items) <= max_frames


def test_greedy_smallest_first():
    """Sizes 16, 4, 64, 8 with budget 32: 4 + 8 + 16 share a batch; 64 runs alone, eagerly."""
    batches = pack([(1, 4, 4), (1, 2, 2), (1, 8, 8), (1, 2, 4)], 32, 8, 8)
    assert sorted((b.items, b.eager) for b in batches) == [((1, 3, 0), False), ((2,), True)]
