"""Choosing each attention group's kernel by timing: the fastest wins, failures are skipped, timings cached."""

import logging

import torch

from vgraph_compile.rewrite.kernel_choice import (
    GroupShape,
    _candidates,
    fastest_kernel,
    group_kernels,
    group_offsets,
)


def test_fastest_wins_failures_are_skipped_and_timings_cached(caplog):
    timed = []
    fake = {"torch_varlen": 1.7, "cudnn": 1.1}

    def time_ms(name):
        timed.append(name)
        if name == "flex":
            raise RuntimeError("no kernel for head_dim 80")
        return fake[name]

    cache = {}
    with caplog.at_level(logging.WARNING):
        assert fastest_kernel("H200|1x9216", ["torch_varlen", "flex", "cudnn"], cache, time_ms) == "cudnn"
    assert "kernel flex skipped for H200|1x9216: no kernel for head_dim 80" in caplog.text
    assert cache == {"H200|1x9216": {"torch_varlen": 1.7, "cudnn": 1.1}}
    fake["cudnn"] = 9.0  # a second start reads the cache: no timing, same choice
    assert fastest_kernel("H200|1x9216", ["torch_varlen", "flex", "cudnn"], cache, time_ms) == "cudnn"
    assert timed == ["torch_varlen", "flex", "cudnn"]


def test_window_shape_keeps_its_own_choice():
    cache = {"H200|144x64": {"torch_varlen": 0.10, "cudnn": 0.12}, "H200|1x9216": {"torch_varlen": 1.7, "cudnn": 1.1}}
    unused = lambda name: (_ for _ in ()).throw(AssertionError("timed a cached shape"))  # noqa: E731
    assert fastest_kernel("H200|144x64", ["torch_varlen", "cudnn"], cache, unused) == "torch_varlen"
    assert fastest_kernel("H200|1x9216", ["torch_varlen", "cudnn"], cache, unused) == "cudnn"


def test_no_kernel_ran():
    def broken(name):
        raise RuntimeError("out of memory")

    assert fastest_kernel("k", ["torch_varlen"], {}, broken) is None


def test_auto_never_times_the_reference_or_flex():
    """Both run on the CPU in fp32, yet auto times neither (the reference is never fastest; flex compiles per
    shape and was slowest on every measured shape); the dense SDPA kernel it does time runs there too."""
    assert _candidates(torch.device("cpu"), torch.float32) == ["dense_flash"]


def test_full_call_offsets_are_padded_to_the_bucket_capacity():
    """A bucket one image fills: one segment, then empty ones up to the capacity; a ragged last segment is kept."""
    assert group_offsets(GroupShape(100, 100, 3, 2, 8, torch.float16)).tolist() == [0, 100, 100, 100]
    assert group_offsets(GroupShape(100, 40, 4, 2, 8, torch.float16)).tolist() == [0, 40, 80, 100, 100]
    assert group_offsets(GroupShape(120, 40, 2, 2, 8, torch.float16)).tolist() == [0, 40, 80, 120]


def _shape(rows, segment, capacity):
    return GroupShape(rows, segment, capacity, 16, 72, torch.bfloat16)


def _key(shape, names):
    return f"{shape.rows}x{shape.segment}x{shape.capacity}|{','.join(names)}"


def test_whole_rows_kernels_serve_one_segment_calls_only_and_only_where_they_save_enough():
    """Dense is fastest on every shape, but its work follows the bucket's rows: a bucket of several slots gets the
    varlen kernel, a bucket of one slot may get dense, and a one-segment call gets dense only where the saving over
    the group's sites reaches ``EXACT_WORTH_MS``."""
    timed = []

    def time_ms(name, shape):
        timed.append((name, shape.rows, shape.capacity))
        per_row = {"torch_varlen": 2e-4, "dense_cudnn": 1e-4}[name]  # ms per row: dense twice as fast
        return per_row * shape.rows

    by_rows = {64: _shape(64, 64, 8), 16384: _shape(16384, 16384, 8)}
    names = ["torch_varlen", "dense_cudnn"]
    # 27 sites: at 64 rows dense saves 27 * 0.0064 ms (< 1 ms), at 16384 rows 27 * 1.64 ms
    chosen = group_kernels(by_rows, names, 27, time_ms, {}, _key)
    assert chosen == "64:torch_varlen;16384:torch_varlen;1x64:torch_varlen;1x16384:dense_cudnn"
    assert ("dense_cudnn", 64, 8) not in timed and ("dense_cudnn", 16384, 8) not in timed
    assert ("dense_cudnn", 64, 1) not in timed  # varlen alone takes 27 * 0.0128 ms there: nothing could save 1 ms
    assert ("dense_cudnn", 16384, 1) in timed
    assert group_kernels({16384: _shape(16384, 16384, 1)}, names, 27, time_ms, {}, _key) == "dense_cudnn"


def test_window_groups_get_no_one_segment_entries():
    """A window group's segments never fill the bucket: only its bucket shapes are timed."""
    timed = []

    def time_ms(name, shape):
        timed.append(shape.capacity)
        return {"torch_varlen": 1.0, "cudnn": 2.0}[name]

    by_rows = {4096: _shape(4096, 64, 64), 16384: _shape(16384, 64, 256)}
    assert group_kernels(by_rows, ["torch_varlen", "cudnn"], 28, time_ms, {}, _key) == "torch_varlen"
    assert 1 not in timed


def test_a_bucket_whose_kernels_all_fail_leaves_the_group_unchosen(caplog):
    def broken(name, shape):
        raise RuntimeError("unsupported")

    by_rows = {4096: _shape(4096, 4096, 8)}
    with caplog.at_level(logging.WARNING):
        assert group_kernels(by_rows, ["torch_varlen", "cudnn"], 4, broken, {}, _key) is None


def test_buckets_inside_a_short_agreeing_stretch_take_their_kernels_untimed():
    """Seven buckets of several slots, bisected: the smallest and the largest are timed, then the middle of each
    stretch that spans more than ``AGREEING_SPAN`` or whose ends differ (the crossing, here at 3000 rows); a bucket
    inside a stretch of at most 4x whose ends agree takes their kernel untimed. The choice equals timing every
    bucket."""
    timed = []

    def time_ms(name, shape):
        timed.append((name, shape.rows))
        faster = "torch_varlen" if shape.rows < 3000 else "cudnn"
        return 1.0 if name == faster else 2.0

    rows = [256, 512, 1024, 2048, 4096, 8192, 16384]
    by_rows = {r: _shape(r, 64, 8) for r in rows}  # window-like: no one-segment entries
    chosen = group_kernels(by_rows, ["torch_varlen", "cudnn"], 28, time_ms, {}, _key)
    assert chosen == (
        "256:torch_varlen;512:torch_varlen;1024:torch_varlen;2048:torch_varlen;4096:cudnn;8192:cudnn;16384:cudnn"
    )
    assert sorted({r for _, r in timed}) == [256, 512, 2048, 4096, 16384]  # 1024 and 8192 inside agreeing stretches


def test_the_default_budgets_with_one_choice_throughout_time_six_buckets():
    """The 29 default budgets (256 to 16384 patches), one kernel fastest everywhere: six buckets are timed (the two
    ends, then the middles of the stretches wider than ``AGREEING_SPAN``), and every bucket gets that kernel."""
    from vgraph_compile.config import VGraphConfig

    budgets = VGraphConfig(min_tokens=256, max_tokens=16384).budgets
    timed = set()

    def time_ms(name, shape):
        timed.add(shape.rows)
        return {"torch_varlen": 2.0, "cudnn": 1.0}[name] * shape.rows

    by_rows = {r: _shape(r, 64, 8) for r in budgets}
    assert len(budgets) == 29
    assert group_kernels(by_rows, ["torch_varlen", "cudnn"], 28, time_ms, {}, _key) == "cudnn"
    assert len(timed) == 6 and {budgets[0], budgets[-1]} <= timed
