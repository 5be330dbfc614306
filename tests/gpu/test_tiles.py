"""On a CUDA GPU: a fixed-tile tower over its tile buckets with inductor and CUDA graphs, one tile replayed in a graph
of one tile. Run with ``pytest -m gpu``."""

import pytest
import torch

from vgraph_compile.counters import counters
from vgraph_compile.hf.whole_graph.tiles import compile_tile_tower

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", minversion="5.23")

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8
)


def _relative(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("head", [True, False], ids=["map_head", "no_head"])
def test_one_tile_replays_a_graph_of_one_tile(head, monkeypatch):
    """SigLIP with its MAP head (whose trace dynamic in N guards N != 1) and without: N = 1, 2, 3 and 7 (4 + 3) match
    the stock tower in fp32 (cuDNN's TF32 convolutions off in both), each chunk one replay, and one tile replays a
    captured graph of one tile, never the bucket of 2."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    config = transformers.SiglipVisionConfig(vision_use_head=head, **TINY)
    tower = transformers.SiglipVisionModel(config).cuda().eval()
    compiled = compile_tile_tower(tower, max_items=4, exact_items=4, call_choice="smallest_bucket")
    with torch.inference_mode():
        compiled(torch.randn(2, 3, 32, 32, device="cuda"))  # the trace (and the one-tile graph where it is needed)
        hits = {bucket.shape.budget: bucket for runtime in compiled.runtimes for bucket in runtime.buckets}
        assert sorted(hits) == [1, 2, 3, 4]
        before = {budget: bucket.stats.hits for budget, bucket in hits.items()}
        with counters.expect(replays=5):  # N = 1, 2, 3: one each; N = 7: two
            for tiles in (1, 2, 3, 7):
                pixels = torch.randn(tiles, 3, 32, 32, device="cuda")
                got, want = compiled(pixels), tower(pixels)
                assert _relative(got.last_hidden_state, want.last_hidden_state) <= 1e-5
                if head:
                    assert _relative(got.pooler_output, want.pooler_output) <= 1e-5
    assert {budget: bucket.stats.hits - before[budget] for budget, bucket in hits.items()} == {1: 1, 2: 1, 3: 2, 4: 1}
    assert all(bucket.graph is not None for bucket in hits.values())  # every bucket a captured CUDA graph
