"""compile/call_costs: the table's exact-size time between budgets, and the warm-up's measurement of a real encoder,
each bucket timed full (random token rows, segments of the bucket's max_seqlen up to its rows)."""

import pytest
import torch

import vgraph_compile
from vgraph_compile.serve.call_costs import CallCosts, fill_full
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


def test_exact_size_time_is_linear_between_budgets_and_held_below_the_smallest():
    costs = CallCosts(budgets=(16, 64, 128), replay_ms=(1.0, 2.0, 3.0), exact_ms=(4.0, 8.0, 16.0))
    assert costs.exact(8) == 4.0  # below the smallest budget: its time
    assert costs.exact(40) == 6.0  # halfway from 16 to 64: halfway from 4 to 8
    assert costs.exact(96) == 12.0
    assert costs.exact(160) == 20.0  # past the largest: the last slope (8 ms per 64 rows)
    assert costs.replay(64) == 2.0


def test_a_table_needs_one_time_per_budget_in_order():
    with pytest.raises(ValueError, match="one replay and one exact-size time per budget"):
        CallCosts(budgets=(64, 16), replay_ms=(1.0, 2.0), exact_ms=(1.0, 2.0))
    with pytest.raises(ValueError, match="one replay and one exact-size time per budget"):
        CallCosts(budgets=(16, 64), replay_ms=(1.0,), exact_ms=(1.0, 2.0))


def test_the_warmup_times_every_bucket_and_fills_each_full():
    """Both times of every bucket are measured; the fill they are measured on cuts a bucket's rows into segments
    of its max_seqlen (here the bucket's 40 rows: one segment of 40, then empty ones, not a call with no tokens)
    and holds random patches (no zero row)."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(
        model, token_budgets=(16, 40), max_segments=6, compiler="eager", call_choice="measured"
    )
    with torch.no_grad():
        compiled(*pack_images([3, 4], 12))
    runtime = compiled.vgraph.runtimes[0]
    assert runtime.costs.budgets == (16, 40) and min(runtime.costs.replay_ms + runtime.costs.exact_ms) > 0
    large = runtime.buckets[1]
    roles = runtime.encoder.roles
    fill_full(large, runtime.spec, roles, torch.Generator().manual_seed(1))
    offsets = next(buffer for index, buffer in large.buffers.items() if roles[index].value == "segment_offsets")
    patches = next(buffer for index, buffer in large.buffers.items() if roles[index].value == "tokens")
    max_seqlen = large.shape.max_seqlen[0]
    expected = [min(segment * max_seqlen, 40) for segment in range(offsets.shape[0])]
    assert offsets.tolist() == expected and expected[1] > 0
    assert patches.shape[0] == 40 and bool((patches.abs().sum(-1) > 0).all())
