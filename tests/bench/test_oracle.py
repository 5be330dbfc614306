import pytest
import torch

from vgraph_compile.bench.oracle import ExactShape
from vgraph_compile.bench.timing import cuda_graph_captures
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.grid_metadata import GridMetadata
from vgraph_compile.hf.interface.packed_tower import learn_packed_tower


def test_exact_shape_graph_equals_the_routed_tower_and_serves_its_grid_only(bench_tower):
    """On the CPU the oracle runs its compiled code on its static buffers: equal to the routed eager tower, and a
    second call with other pixels overwrites the buffers rather than reusing the first call's result."""
    tower = bench_tower
    grid = ((1, 8, 8), (2, 4, 8))
    (width,) = learn_packed_tower(tower).pixel_shape
    grid_thw = torch.tensor(grid)
    with torch.no_grad():
        metadata = GridMetadata(tower, learn_packed_tower(tower))
        exact = ExactShape(tower, grid, metadata, torch.full((128, width), float("nan")), "eager")
        for _ in range(2):
            pixels = torch.randn(128, width)
            with routed_attention(tower):
                ref = tower(pixels, grid_thw)
            pooled, hidden = exact(pixels, grid_thw)
            torch.testing.assert_close(pooled, ref.pooler_output, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"serves grid_thw \[\(1, 8, 8\), \(2, 4, 8\)\] only"):
            exact(torch.randn(64, width), torch.tensor([(1, 8, 8)]))


@pytest.mark.gpu
def test_exact_shape_graph_captures_once_and_replays_the_tower(bench_tower):
    """One CUDA graph per oracle; calls replay it (no further capture) and equal the routed tower."""
    tower = bench_tower.cuda()
    grid = ((1, 8, 8), (2, 4, 8))
    (width,) = learn_packed_tower(tower).pixel_shape
    grid_thw = torch.tensor(grid)
    with torch.no_grad():
        before = cuda_graph_captures()
        metadata = GridMetadata(tower, learn_packed_tower(tower))
        exact = ExactShape(tower, grid, metadata, torch.zeros(128, width, device="cuda"), "eager")
        assert cuda_graph_captures() - before == 1
        for _ in range(3):
            pixels = torch.randn(128, width, device="cuda")
            with routed_attention(tower):
                ref = tower(pixels, grid_thw.cuda())
            torch.testing.assert_close(exact(pixels, grid_thw)[0], ref.pooler_output, rtol=1e-4, atol=1e-4)
        assert cuda_graph_captures() - before == 1
