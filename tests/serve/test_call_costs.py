"""compile/call_costs: the table's exact-size time between budgets, and the warm-up's measurement of a real encoder,
each bucket timed full (random token rows, segments of the bucket's max_seqlen up to its rows)."""

import pytest
import torch

import vgraph_compile
from vgraph_compile.serve.call_costs import (
    EXACT_HOST_SHARE,
    ONE_SEGMENT_HOST_SHARE,
    CallCosts,
    PaddingCosts,
    fill_full,
    load_padding_costs,
    measure_padding_costs,
    save_padding_costs,
)
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


def test_exact_size_saves_where_launches_hide_behind_the_rows_work_and_padding_is_worth_it():
    """Bucket 8192 replays in 40 ms with no segment (100 ms with one filling it), and the exact run launches in 2 ms
    on the host: a call of 4096 rows does at least 20 ms of work there (2 <= 0.5 * 20) and spares 20 ms of padding;
    8100 rows spare 0.44 ms, under 2% of their 39.6; the 1024 bucket's 2 ms cannot hide 2 ms of launches, but one
    segment filling it, 5 ms, can; 512 was never timed."""
    costs = PaddingCosts(budgets=(1024, 8192), empty_ms=(2.0, 40.0), full_ms=(5.0, 100.0), exact_host_ms=2.0)
    assert costs.exact_saves(8192, 4096)
    assert not costs.exact_saves(8192, 8100)
    assert costs.exact_saves(8192, 7900)  # 1.44 ms spared, 3.7% of 38.6
    assert not costs.exact_saves(8192, 800)  # 3.9 ms of work: launches not hidden
    assert not costs.exact_saves(1024, 600)
    assert not costs.exact_saves(512, 300)
    assert costs.launch_hides(costs.one_segment_work(1024, 1000)) and not costs.launch_hidden(1024, 1000)
    assert not costs.launch_hides(costs.one_segment_work(1024, 600))  # 2.9 ms of work
    assert not costs.launch_hides(costs.one_segment_work(512, 500))


def test_a_one_segment_calls_measured_launch_replaces_the_warmups():
    """Once a one-segment exact run measured its own launch, one-segment calls are weighed by it, within
    ``ONE_SEGMENT_HOST_SHARE`` of their rows' share of the one-segment replay (bucket 8192: 100 ms; 4096 rows:
    50 ms), whatever the warm-up's launch time; calls of several segments keep the warm-up's."""
    costs = PaddingCosts(budgets=(1024, 8192), empty_ms=(2.0, 40.0), full_ms=(5.0, 100.0), exact_host_ms=2.0)
    work = costs.one_segment_work(8192, 4096)
    assert work == 50.0 and costs.launch_hides(work)
    assert costs.launch_hides(work, one_segment_host_ms=ONE_SEGMENT_HOST_SHARE * 50)
    assert not costs.launch_hides(work, one_segment_host_ms=ONE_SEGMENT_HOST_SHARE * 50 + 1)
    assert costs.launch_hidden(8192, 4096)  # several segments: the warm-up's 2 ms
    assert costs.one_segment_work(512, 500) is None
    assert not costs.launch_hides(None, one_segment_host_ms=0.1)  # an untimed bucket


def test_padding_costs_time_buckets_largest_first_down_to_the_first_that_hides_no_launch():
    """The timed budgets are the largest ones, each but the smallest of them hiding the exact run's launches behind
    its one-segment replay, and that smallest hiding none unless it is the smallest bucket (on the CPU the exact run's host time is its whole
    time, so the walk stops early)."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(model, token_budgets=(16, 40, 64), max_segments=6, compiler="eager")
    with torch.no_grad():
        compiled(*pack_images([3, 4], 12))
    runtime = compiled.vgraph.runtimes[0]
    buckets = runtime.buckets
    costs = measure_padding_costs(
        buckets, lambda bucket: bucket.run(runtime.encoder.compiled), runtime.encoder.compiled, runtime.spec,
        runtime.encoder.roles, torch.device("cpu"),
    )
    budgets = tuple(bucket.shape.budget for bucket in buckets)
    assert costs.budgets == budgets[-len(costs.budgets) :] and costs.exact_host_ms > 0
    assert min(costs.empty_ms + costs.full_ms) > 0
    hides = [costs.exact_host_ms <= EXACT_HOST_SHARE * ms for ms in costs.full_ms]
    assert all(hides[1:]) and (not hides[0] or costs.budgets[0] == budgets[0])


def test_offsets_made_from_the_grid_are_filled_with_one_segment_of_max_seqlen():
    """An HF tower's ``cu_seqlens`` come from its grid (the group's end is not tied to a row count): the full fill
    gives that group one segment of the bucket's ``max_seqlen`` rows, so the one-segment replay the exact-size rule
    weighs runs attention over them, and the compiled code runs the fill to finite rows."""
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    tower = qwen_tower("qwen2-vl", torch.device("cpu"), torch.float32, **TOY_SIZES["qwen2-vl"])
    compiled = compile_vision_tower(tower, token_budgets=[64, 256], max_items=3, compiler="eager")
    with torch.no_grad():
        compiled(torch.randn(64, *compiled.interface.pixel_shape), torch.tensor([[1, 8, 8]]))
    (runtime,) = compiled.runtimes
    (group,) = runtime.spec.groups
    assert group.ends_at is None
    roles, bucket = runtime.encoder.roles, runtime.buckets[-1]
    fill_full(bucket, runtime.spec, roles, torch.Generator().manual_seed(0))
    length = bucket.shape.max_seqlen[0]
    offsets = bucket.buffers[group.offsets_input].tolist()
    assert offsets == [0] + [length] * (len(offsets) - 1) and length > 0
    with torch.no_grad():
        outputs = bucket.run(runtime.encoder.compiled)
    tensors = [out for out in outputs if isinstance(out, torch.Tensor)]
    assert tensors and all(bool(torch.isfinite(out).all()) for out in tensors)


def test_padding_costs_saved_under_a_key_load_equal_and_other_keys_load_nothing(tmp_path, monkeypatch):
    """A warm start loads what a cold one measured for the same compiled code and buckets; another key, or a file
    that is not the saved form, gives None (measured again)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    costs = PaddingCosts(budgets=(1024, 8192), empty_ms=(2.0, 40.0), full_ms=(5.0, 100.0), exact_host_ms=2.5)
    save_padding_costs("code|1024,8192", costs)
    assert load_padding_costs("code|1024,8192") == costs
    assert load_padding_costs("code|8192") is None
    (tmp_path / "vgraph_padding_costs.json").write_text('{"code|1024,8192": [1, 2]}')
    assert load_padding_costs("code|1024,8192") is None
