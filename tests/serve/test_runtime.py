"""The runtime end to end on CPU: compiled buckets against the eager encoder, bucket choice, fallbacks, checks."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import counter_changes
from vgraph_compile.serve.call_costs import CallCosts, PaddingCosts
from vgraph_compile.counters import counters
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import cu_seqlens
from vgraph_compile.rewrite import kernel_choice
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.serve.runtime import CAPTURE_GAP_S, EXACT, PADDED, SPLIT, STOCK

BUDGETS = (16, 64, 128)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return PackedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval()


@pytest.fixture(scope="module")
def compiled(model):
    """The graph run as FX (compiler='eager'): fast to build, same passes, buckets and runtime.
    Warmed up: 2 sites found once; 3 buckets built; the kernel of both sites set in the eager and compiled copies."""
    compiled = vgraph_compile.encoder(
        model, token_budgets=BUDGETS, max_segments=6, compiler="eager", attention_backend="sdpa"
    )
    with torch.no_grad(), counters.expect(traces=1, sites_found=2, buckets_built=3, nodes_rewritten=4, replays=1):
        compiled(*pack_images([5, 7], 12))
    return compiled


segments = st.lists(st.integers(1, 48), min_size=1, max_size=6).filter(lambda lengths: sum(lengths) <= 200)


@given(lengths=segments)
def test_matches_eager_on_generated_shapes(model, compiled, lengths):
    """Every real row equals eager (same SDPA kernel) within fp32 round-off; a call within the largest budget is
    served by a bucket graph, one over it runs eagerly."""
    inputs = pack_images(lengths, 12)
    fits = sum(lengths) <= BUDGETS[-1]
    with torch.no_grad(), counters.expect(replays=int(fits), eager_fallbacks=int(not fits)):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "lengths, bucket",
    [
        ([1, 1, 1], 16),  # 1-token segments
        ([16], 16),  # one segment filling a budget exactly
        ([60, 4], 64),  # a call exactly at a budget
        ([17], 64),  # one token over a budget: the next one
        ([1] * 6, 16),  # as many segments as max_segments
        ([1] * 7, None),  # more segments than any bucket holds: eager
        ([129], None),  # over the largest budget: eager
    ],
)
def test_bucket_choice_and_fallback(model, compiled, lengths, bucket):
    runtime = compiled.vgraph.runtimes[0]
    inputs = pack_images(lengths, 12)
    hits_before = {b.shape.budget: b.stats.hits for b in runtime.buckets}
    with torch.no_grad(), counters.expect(replays=int(bucket is not None), eager_fallbacks=int(bucket is None)):
        out = compiled(*inputs)
        torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    hits = {b.shape.budget: b.stats.hits - hits_before.get(b.shape.budget, 0) for b in runtime.buckets}
    assert hits == {budget: int(budget == bucket) for budget in BUDGETS}


def test_stats_table(model):
    compiled = vgraph_compile.encoder(model, token_budgets=(16, 64), max_segments=4, compiler="eager")
    with torch.no_grad():
        for lengths in ([8], [8, 8], [40], [100]):
            compiled(*pack_images(lengths, 12))
    table = compiled.vgraph.runtimes[0].stats_table()
    assert "      16       [4]        [16]      2   25.0%" in table  # 8 and 16 real rows of 2 x 16
    assert "      64       [4]        [64]      1   37.5%" in table  # 40 of 64
    assert "eager fallback x1: no bucket holds" in table


@pytest.mark.parametrize(
    "cu, message",
    [
        ([0, 5, 3, 12], "never decrease"),
        ([0, 5, 11], "end at the row count 12"),
        ([1, 5, 12], "start at 0"),
    ],
)
def test_bad_cu_seqlens_raise_before_any_graph_runs(compiled, cu, message):
    patches = torch.randn(12, 12)
    with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
        compiled(patches, torch.tensor(cu, dtype=torch.int32), 7)


def test_a_one_segment_call_runs_at_its_exact_size_where_its_group_measured_another_kernel(model, monkeypatch):
    """A group whose one-segment entries name another kernel (``registry.by_rows``; the timing that chose it is
    replaced here) sends a call of one segment in that range to the compiled code at its exact sizes, where the op
    runs that kernel; a call of several segments, or one segment where the entries agree, replays its bucket."""
    name = registry.by_rows({16: "sdpa", 64: "sdpa", 128: "sdpa"}, {16: "sdpa", 64: "dense_flash", 128: "dense_flash"})
    monkeypatch.setattr(kernel_choice, "choose_kernels", lambda gm, ctx: {0: name})
    one_segment_model = _OwnTrace(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(
        one_segment_model, token_budgets=BUDGETS, max_segments=6, compiler="eager", attention_backend="sdpa"
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
        runtime = compiled.vgraph.runtimes[0]
        assert runtime.encoder.kernels == {0: name}
        for lengths, replays in (([40], 0), ([100], 0), ([10], 1), ([20, 20], 1), ([3, 90], 1)):
            inputs = pack_images(lengths, 12)
            with counters.expect(replays=replays):
                torch.testing.assert_close(compiled(*inputs), one_segment_model(*inputs), rtol=1e-5, atol=1e-5)
        assert runtime.choices[EXACT] == 2
        # On a GPU, where padding costs are measured: only where the exact run's launch hides behind the call's
        # work (bucket 128: 40 ms of row work, 2 ms of launches; bucket 64 untimed, too small to hide any). 127 rows
        # leave too little padding to leave the graph for, so only the kernel sends them.
        runtime.padding = PaddingCosts(budgets=(128,), empty_ms=(40.0,), full_ms=(60.0,), exact_host_ms=2.0)
        runtime._exact_first_choices.clear()
        for lengths, replays in (([40], 1), ([127], 0), ([3, 124], 1)):
            inputs = pack_images(lengths, 12)
            with counters.expect(replays=replays):
                torch.testing.assert_close(compiled(*inputs), one_segment_model(*inputs), rtol=1e-5, atol=1e-5)
        # that exact run timed its own launch; a launch no call's work hides sends one-segment calls back to their
        # bucket, a small one sends them out again (the choices made before are made again)
        assert set(runtime.one_segment_host_ms) == {False} and "first run of its sizes" in runtime.stats_table()
        # sizes seen before are weighed by a later run's launch, new sizes by a first run's, at every call
        for first, later, lengths, replays in (
            (1e6, 1e-3, [127], 0), (1e-3, 1e6, [127], 1), (1e6, 1e-3, [126], 1), (1e-3, 1e6, [126], 0)
        ):
            runtime.one_segment_host_ms.update({False: first, True: later})  # weighed per call: no choice dropped
            inputs = pack_images(lengths, 12)
            with counters.expect(replays=replays):
                torch.testing.assert_close(compiled(*inputs), one_segment_model(*inputs), rtol=1e-5, atol=1e-5)
    assert runtime.choices[EXACT] == 5


class _OwnTrace(PackedViT):
    """``PackedViT`` under a forward of its own: dynamo's per-code recompile limit, which this module's other
    encoders of ``PackedViT.forward`` approach, does not count its trace."""

    def forward(self, *args):
        return super().forward(*args)


def test_a_call_whose_padding_costs_more_than_the_exact_launch_runs_at_its_exact_size(model, compiled):
    """With padding costs of the shape a large tower measures on a GPU (bucket 128: 40 ms of row work, 2 ms of
    launches), a call of 100 rows runs the compiled code at its sizes; a call of 126 rows (2% of padding is
    not worth it) and one in bucket 64 (never timed: too small to hide launches) replay their buckets; threads
    whose calls take either route get their own rows."""
    runtime = compiled.vgraph.runtimes[0]
    exact_before = runtime.choices[EXACT]
    runtime.padding = PaddingCosts(budgets=(128,), empty_ms=(40.0,), full_ms=(60.0,), exact_host_ms=2.0)
    runtime._exact_first_choices.clear()
    try:
        with torch.no_grad():
            for lengths, replays in (([60, 40], 0), ([100], 0), ([70, 56], 1), ([30, 30], 1)):
                inputs = pack_images(lengths, 12)
                with counters.expect(replays=replays):
                    torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
        assert runtime.choices[EXACT] == exact_before + 2
        # callers on four threads at once, calls of either route interleaved, each gets its own rows
        assert _wrong_from_threads(compiled, model, 10) == [0, 0, 0, 0]
        assert runtime.choices[EXACT] > exact_before + 2
    finally:
        runtime.padding = None
        runtime._exact_first_choices.clear()


@pytest.fixture(scope="module")
def one_block():
    """A one-block encoder for the inductor tests (the compile's cost on the CPU grows with the blocks)."""
    torch.manual_seed(0)
    return PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()


@pytest.fixture(scope="module")
def inductor_compiled(one_block):
    """One trace and ONE inductor compile serve 4 buckets (16 .. 128 tokens); warmed up under no_grad."""
    compiled = vgraph_compile.encoder(one_block, token_budgets=(16, 32, 64, 128), max_segments=8)
    with (
        torch.no_grad(),
        counters.expect(traces=1, sites_found=1, buckets_built=4, compiles=1, nodes_rewritten=2, replays=1),
    ):
        compiled(*pack_images([3, 5], 12))
    return compiled


def test_inductor_buckets_serve_100_calls_from_one_compile(one_block, inductor_compiled):
    """100 random calls over every bucket: eager-equal, no retrace, no compile, all replays."""
    rng = random.Random(0)
    calls = [[rng.randint(1, 16) for _ in range(rng.randint(1, 8))] for _ in range(100)]  # <= 128 tokens
    with torch.no_grad(), counters.expect(replays=100):
        for lengths in calls:
            inputs = pack_images(lengths, 12)
            torch.testing.assert_close(inductor_compiled(*inputs), one_block(*inputs), rtol=1e-5, atol=1e-5)
    assert len(inductor_compiled.vgraph.runtimes) == 1
    assert {bucket.stats.hits > 0 for bucket in inductor_compiled.vgraph.runtimes[0].buckets} == {True}


def test_inductor_code_runs_at_exact_sizes_without_a_bucket(one_block, inductor_compiled):
    """call_choice="exact_size": the one inductor compile runs at each call's own sizes (no replay, no padding)
    and matches eager; the size guards it needs are known from the build."""
    runtime = inductor_compiled.vgraph.runtimes[0]
    assert runtime.encoder.record.size_guards is not None
    runtime.call_choice = "exact_size"
    try:
        with torch.no_grad(), counters.expect(replays=0):
            for lengths in ([3], [7, 9, 1], [40, 41, 20]):
                inputs = pack_images(lengths, 12)
                torch.testing.assert_close(inductor_compiled(*inputs), one_block(*inputs), rtol=1e-5, atol=1e-5)
        assert runtime.choices[EXACT] == 3
    finally:
        runtime.call_choice = "smallest_bucket"


def test_grad_modes_never_retrace(one_block, inductor_compiled):
    """inference_mode, no_grad, then grad enabled, then inference_mode again: one trace, no crash."""
    inputs = pack_images([7, 9], 12)
    expected = one_block(*inputs).detach()
    with counters.expect(replays=3):
        with torch.inference_mode():
            torch.testing.assert_close(inductor_compiled(*inputs), expected, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(inductor_compiled(*inputs), expected, rtol=1e-5, atol=1e-5)
        out = inductor_compiled(*inputs)  # grad enabled on trainable parameters: the encoder as written
        assert out.requires_grad and out.grad_fn is not None
        with torch.inference_mode():
            torch.testing.assert_close(inductor_compiled(*inputs), expected, rtol=1e-5, atol=1e-5)
    assert len(inductor_compiled.vgraph.runtimes) == 1


def _wrong_from_threads(compiled, model, calls: int) -> list[int]:
    """Four threads, each making ``calls`` calls of its own random sizes at once: per thread, how many results were
    not eager-equal (a thread's exception is raised here)."""
    import concurrent.futures

    def worker(seed):
        rng = random.Random(seed)
        wrong = 0
        for _ in range(calls):
            inputs = pack_images([rng.randint(1, 30) for _ in range(rng.randint(1, 4))], 12)
            with torch.no_grad():
                out, expected = compiled(*inputs), model(*inputs)
            wrong += not torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
        return wrong

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(worker, range(4)))


def test_concurrent_callers_get_their_own_rows(one_block, inductor_compiled):
    """4 threads x 25 calls of different sizes through the shared bucket buffers: every result eager-equal."""
    assert _wrong_from_threads(inductor_compiled, one_block, 25) == [0, 0, 0, 0]


def test_concurrent_callers_under_the_measured_choice_get_their_own_rows(model):
    """call_choice switched to "measured" between calls (allowed): four threads calling at once find no cost
    table, one measures it (filling and running every bucket) while the others wait; every result is eager-equal,
    whichever way it was served, and no thread raises."""
    compiled = vgraph_compile.encoder(
        model, token_budgets=BUDGETS, max_segments=6, compiler="eager", attention_backend="sdpa"
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
    runtime = compiled.vgraph.runtimes[0]
    runtime.call_choice = "measured"
    assert _wrong_from_threads(compiled, model, 10) == [0, 0, 0, 0]
    assert runtime.costs is not None and sum(runtime.choices.values()) == 40


def test_nan_poisoned_buffers_never_reach_real_rows(one_block, inductor_compiled):
    """Every bucket buffer (shared storages included) filled with NaN before each call: real rows stay exact."""
    runtime = inductor_compiled.vgraph.runtimes[0]
    for lengths in ([1], [16], [40, 3], [100, 28]):
        for bucket in runtime.buckets:
            for buffer in bucket.buffers.values():
                buffer.fill_(float("nan") if buffer.is_floating_point() else -7)
        inputs = pack_images(lengths, 12)
        with torch.no_grad():
            torch.testing.assert_close(inductor_compiled(*inputs), one_block(*inputs), rtol=1e-5, atol=1e-5)


grids = st.lists(
    st.tuples(
        st.sampled_from([1, 1, 2]), st.integers(1, 6).map(lambda a: 2 * a), st.integers(1, 6).map(lambda b: 2 * b)
    ),
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module")
def windowed():
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY
    from vgraph_compile.sample_models.packed_vit import WindowedViT

    torch.manual_seed(0)
    model = WindowedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(
        model,
        token_budgets=(64, 256),
        compiler="eager",
        geometry=QWEN25_GEOMETRY,
        max_items=4,
        max_frames=8,
        attention_backend="sdpa",
    )
    return model, compiled


@given(grid=grids)
def test_window_attention_encoder_matches_eager(windowed, grid):
    """Frames, windows and the window permutation padded by their roles: real rows equal eager, any grid; a grid
    within the largest budget and max_frames is served by a bucket graph (the bounds hold every window), a larger
    one runs eagerly."""
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs

    model, compiled = windowed
    inputs = windowed_inputs(QWEN25_GEOMETRY, grid, 12)
    fits = sum(t * h * w for t, h, w in grid) <= 256 and sum(t for t, _, _ in grid) <= 8
    with torch.no_grad(), counter_changes() as changes:
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert (changes["replays"], changes["eager_fallbacks"]) == (int(fits), int(not fits)), changes


def test_keyed_calls_take_their_metadata_from_the_bytes_staged_at_the_keys_first_call(windowed):
    """Calls keyed by their grid: each key's first call fills by the rules and stages its bucket's metadata region
    (cu_seqlens, window offsets, window index); a later call with the key, after another grid's call and with the
    region poisoned, takes the staged bytes in one copy: real rows equal eager, every call a replay."""
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs

    model, compiled = windowed
    grids = {"two images": ((1, 8, 12), (1, 4, 4)), "one image": ((1, 8, 8),)}
    inputs = {name: windowed_inputs(QWEN25_GEOMETRY, list(grid), 12) for name, grid in grids.items()}
    with torch.no_grad():
        compiled(*windowed_inputs(QWEN25_GEOMETRY, [(1, 4, 8)], 12))  # traced here when this test runs alone
    with torch.no_grad(), counters.expect(replays=5):
        for name in ("two images", "one image", "two images", "one image"):
            out = compiled.call_keyed(grids[name], *inputs[name])
            torch.testing.assert_close(out, model(*inputs[name]), rtol=1e-5, atol=1e-5)
        runtime = compiled.vgraph.runtimes[0]
        assert sorted(key for key, _ in runtime._staged) == sorted(grids.values())
        for bucket in runtime.buckets:
            bucket.region.fill_(0xF9)  # -7 in every int32 entry, and in the window index
        out = compiled.call_keyed(grids["two images"], *inputs["two images"])
    assert out.isfinite().all()
    torch.testing.assert_close(out, model(*inputs["two images"]), rtol=1e-5, atol=1e-5)


def test_a_keys_later_calls_are_served_straight_and_equal_the_checked_path(windowed, monkeypatch):
    """A key's calls after its first replay skip the size checks and the bucket choice (``_keyed``): equal to the
    same call unkeyed (checked, filled by the rules) and to eager; a new key is checked and kept; token rows of
    another dtype take the checked path, whose ValueError comes before anything runs."""
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs

    model, compiled = windowed
    grid, other = ((1, 8, 12), (1, 4, 4)), ((1, 4, 8),)
    inputs = windowed_inputs(QWEN25_GEOMETRY, list(grid), 12)
    with torch.no_grad():
        unkeyed = compiled(*inputs)
        compiled.call_keyed(grid, *inputs)
        runtime = compiled.vgraph.runtimes[0]
        assert grid in runtime._keyed
        checked = []
        check = runtime.checks.check
        monkeypatch.setattr(runtime.checks, "check", lambda args: checked.append(1) or check(args))
        fresh = (inputs[0].clone().normal_(), *inputs[1:])
        with counters.expect(replays=2):
            keyed = compiled.call_keyed(grid, *inputs)
            keyed_fresh = compiled.call_keyed(grid, *fresh)
        assert not checked
        torch.testing.assert_close(keyed, unkeyed, rtol=0, atol=0)
        torch.testing.assert_close(keyed_fresh, model(*fresh), rtol=1e-5, atol=1e-5)
        other_inputs = windowed_inputs(QWEN25_GEOMETRY, list(other), 12)
        out = compiled.call_keyed(other, *other_inputs)
        torch.testing.assert_close(out, model(*other_inputs), rtol=1e-5, atol=1e-5)
        assert checked and other in runtime._keyed
        with pytest.raises(ValueError, match="float64"), counters.expect(replays=0):
            compiled.call_keyed(grid, inputs[0].double(), *inputs[1:])


class PackedInput(torch.nn.Module):
    """A model that builds FlashInfer's Q/K/O|V offsets itself and passes them in (as vLLM's Qwen2.5-VL does)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x, qkv_offsets, max_seqlen):
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 4).unbind(1)
        return vgraph_compile.kernels.ops.qkv_offsets_varlen_attention(q.contiguous(), k.contiguous(), v, qkv_offsets, max_seqlen)


def _packed_inputs(lengths):
    cu = cu_seqlens(lengths)
    return torch.randn(sum(lengths), 8), torch.cat([cu * 8, cu * 24]), max(lengths)


@pytest.fixture(scope="module")
def packed_model():
    torch.manual_seed(0)
    model = PackedInput().eval()
    compiled = vgraph_compile.encoder(model, token_budgets=(64, 160), max_segments=6, compiler="eager")
    with torch.no_grad():
        compiled(*_packed_inputs([5, 7]))
    return model, compiled


def test_packed_offsets_input_role(packed_model):
    """The input's role is found from the op it reaches (its segments are half its length, less one)."""
    assert "input qkv_offsets: qkv_offsets" in packed_model[1].vgraph.runtimes[0].spec.format()


# At least 2 rows: with one row, eager's q.contiguous() keeps the fused view's row stride (24), so the model's own
# offsets (which assume 8) would misread eager, not vgraph (whose buffers always have more than one row).
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5).filter(lambda lengths: sum(lengths) > 1))
def test_packed_offsets_input_is_padded_half_by_half(packed_model, lengths):
    model, compiled = packed_model
    inputs = _packed_inputs(lengths)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_metadata_refill_sees_in_place_changes_and_other_buckets(model, compiled):
    """A cu_seqlens tensor passed again is re-copied when it was modified in place (through torch, or through
    numpy, which leaves its version counter alone), or when another bucket wrote the shared storage since."""
    patches, cu, _ = pack_images([5, 7], 12)
    with torch.no_grad():
        torch.testing.assert_close(compiled(patches, cu, 7), model(patches, cu, 7), rtol=1e-5, atol=1e-5)
        cu[1] = 3  # segments of 3 and 9 rows, same tensor object
        torch.testing.assert_close(compiled(patches, cu, 9), model(patches, cu, 9), rtol=1e-5, atol=1e-5)
        compiled(*pack_images([6, 6], 12))  # the same bucket, other offsets, in the shared buffer
        torch.testing.assert_close(compiled(patches, cu, 9), model(patches, cu, 9), rtol=1e-5, atol=1e-5)
        version = cu._version
        cu.numpy()[1] = 8  # segments of 8 and 4 rows; the version counter does not move
        assert cu._version == version
        torch.testing.assert_close(compiled(patches, cu, 8), model(patches, cu, 8), rtol=1e-5, atol=1e-5)


def test_a_bucket_dropped_at_capture_is_never_chosen(model, monkeypatch):
    """The first call plans before the capture; if the capture drops a bucket (out of GPU memory), that call and
    every later one go to the next larger bucket."""
    from vgraph_compile.compile import buckets as bucket_graphs

    def capture_dropping_the_smallest(bucket, compiled, pool, prepare, error_mode):
        return bucket.shape.budget != BUDGETS[0]

    monkeypatch.setattr(bucket_graphs, "capture", capture_dropping_the_smallest)
    monkeypatch.setattr(bucket_graphs, "pool_bytes", lambda pool: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (1, 0))
    # padding costs timing no bucket: no call leaves the buckets for its exact sizes, whatever the machine's load
    no_bucket_timed = PaddingCosts(budgets=(), empty_ms=(), full_ms=(), exact_host_ms=1.0)
    monkeypatch.setattr("vgraph_compile.serve.runtime.measure_padding_costs", lambda *args: no_bucket_timed)
    compiled = vgraph_compile.encoder(
        model, token_budgets=BUDGETS, max_segments=6, compiler="eager", call_choice="smallest_bucket",
        captures="first_call",
    )  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr("vgraph_compile.pipeline.cudagraphs_wanted", lambda ctx: True)
        inputs = pack_images([3, 4], 12)  # fits the 16 bucket, which the capture drops
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
            compiled(*inputs)
    runtime = compiled.vgraph.runtimes[0]
    assert [(bucket.shape.budget, bucket.stats.hits) for bucket in runtime.buckets] == [(64, 2), (128, 0)]


@pytest.fixture
def captures_behind(model, monkeypatch):
    """An inductor-free encoder of ``model`` whose captures run behind its calls on the CPU: each capture takes
    50 ms holding the runtime's lock and records a CPU replay of the compiled code into static outputs. Yields the
    encoder and the captures made, each as (budget, thread name, capture mode, calls served before capture so far,
    (start, end) time)."""
    import threading
    import time

    from vgraph_compile.compile import buckets as bucket_graphs

    captured = []

    class Recorded:
        """A graph's replay on the CPU: the compiled code on the bucket's buffers, into its static outputs."""

        def __init__(self, bucket, compiled):
            self.bucket, self.compiled = bucket, compiled

        def replay(self):
            for static, fresh in zip(self.bucket.outputs, self.compiled(list(self.bucket.inputs))):
                static.copy_(fresh)

    def recording_capture(bucket, compiled, pool, prepare, error_mode):
        begin, served = time.perf_counter(), counters.served_before_capture
        time.sleep(0.05)
        prepare(bucket)
        bucket.graph, bucket.outputs = Recorded(bucket, compiled), compiled(list(bucket.inputs))
        captured.append(
            (bucket.shape.budget, threading.current_thread().name, error_mode, served, (begin, time.perf_counter()))
        )
        return True

    monkeypatch.setattr(bucket_graphs, "capture", recording_capture)
    monkeypatch.setattr(bucket_graphs, "pool_bytes", lambda pool: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (1, 0))
    monkeypatch.setattr("vgraph_compile.serve.runtime.VGraphRuntime._measure_padding", lambda self: None)
    monkeypatch.setattr("vgraph_compile.pipeline.cudagraphs_wanted", lambda ctx: True)
    def encode(patches, cu_seqlens, max_seqlen):  # a frame of its own: the module's forward keeps its recompiles
        return model(patches, cu_seqlens, max_seqlen)

    compiled = vgraph_compile.encoder(  # nothing saved: its build believes it captures graphs
        encode, token_budgets=BUDGETS, max_segments=6, compiler="eager", call_choice="smallest_bucket", artifact_dir=""
    )
    yield compiled, captured
    for runtime in compiled.vgraph.runtimes:
        runtime.stop_captures()


def test_calls_are_served_while_the_captures_run_behind_them(model, captures_behind):
    """``captures="behind"``: the first call starts a thread that captures the buckets largest first, one at a time
    holding the runtime's lock and pausing ``CAPTURE_GAP_S`` between two; the call is served meanwhile, after one
    capture at most, by the compiled code, equal to eager; ``capture_all()`` finishes what is left and returns with
    the buckets final; every bucket is captured once, and later calls replay."""
    compiled, captured = captures_behind
    inputs = pack_images([3, 4], 12)
    served_before = counters.served_before_capture
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert counters.served_before_capture == served_before + 1
    compiled.capture_all()
    runtime = compiled.vgraph.runtimes[0]
    assert runtime.encoder.captured
    with torch.no_grad(), counters.expect(replays=1):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert sorted(budget for budget, *_ in captured) == list(BUDGETS)
    first_budget, first_thread, first_mode, *_ = captured[0]
    assert (first_budget, first_mode) == (BUDGETS[-1], "thread_local") and first_thread.endswith("captures")
    assert captured[1][3] == served_before + 1, "the call waited for more than one capture"
    spans = [span for _, thread, *_, span in captured if thread.endswith("captures")]
    gaps = [later[0] - earlier[1] for earlier, later in zip(spans, spans[1:])]
    assert all(gap >= CAPTURE_GAP_S for gap in gaps), f"no pause for waiting calls between captures: {gaps}"


def test_threads_calling_while_the_captures_run_get_their_own_rows(model, captures_behind):
    """Four threads call the encoder while its buckets are captured behind the calls (the exact-size code, the
    buckets' buffers and the replays, interleaved under the lock): every result equals eager on its own input."""
    import concurrent.futures

    compiled, captured = captures_behind
    with torch.no_grad():
        compiled(*pack_images([5, 6], 12))  # the trace; the captures start
    served_before = counters.served_before_capture

    def worker(seed):
        rng = random.Random(seed)
        worst = 0.0
        with torch.no_grad():
            for _ in range(6):
                inputs = pack_images([rng.randint(1, 40) for _ in range(rng.randint(1, 3))], 12)
                worst = max(worst, (compiled(*inputs) - model(*inputs)).abs().max().item())
        return worst

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert max(pool.map(worker, range(4))) < 1e-5
    assert counters.served_before_capture > served_before, "no thread's call ran while the captures did"
    compiled.capture_all()
    assert sorted(budget for budget, *_ in captured) == list(BUDGETS)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_value_stays_in_its_segment(one_block, inductor_compiled, poison):
    """Through the compiled buckets: a NaN or Inf patch in image 0 leaves image 1's rows finite and as in the
    clean call."""
    patches, cu, max_seqlen = pack_images([9, 14], 12)
    poisoned = patches.clone()
    poisoned[4, 7] = poison
    with torch.no_grad():
        clean = inductor_compiled(patches, cu, max_seqlen)
        out = inductor_compiled(poisoned, cu, max_seqlen)
    assert not out[:9].isfinite().all()
    assert out[9:].isfinite().all()
    torch.testing.assert_close(out[9:], clean[9:], rtol=1e-6, atol=1e-6)


# -- the per-call choice by measured costs -----------------------------------------------------------------------

COSTS = CallCosts(budgets=BUDGETS, replay_ms=(1.0, 2.0, 10.0), exact_ms=(5.0, 6.0, 7.0))
"""A cost table of the shape a large encoder measures at its largest bucket: replays grow with the budget, the
128 bucket costing more than two 64s and more than the exact-size run near 70 rows (6 + 1/64 ms per row over 64)."""
STOCK_MS = {16: [(10, 4.0)], 64: [(40, 8.0)], 128: [(70, 3.5)]}
"""Stock timings that stand for the calls below: dearer than every other choice but at 70 rows in one segment."""


@pytest.fixture(scope="module")
def routed(model):
    """Served with ``call_choice="measured"``: the warm-up (first call) times each bucket's replay and its compiled
    code without a graph."""
    compiled = vgraph_compile.encoder(
        model, token_budgets=BUDGETS, max_segments=6, compiler="eager", attention_backend="sdpa", call_choice="measured"
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
    return compiled, compiled.vgraph.runtimes[0]


def _table(runtime, stock_ms):
    runtime.costs = COSTS
    runtime.stock_ms = {budget: list(samples) for budget, samples in stock_ms.items()}
    runtime._routes.clear()


def test_the_warmup_measures_a_replay_and_an_exact_size_time_per_bucket(routed):
    costs = routed[1].costs
    assert costs.budgets == BUDGETS
    assert all(ms > 0 for ms in costs.replay_ms + costs.exact_ms)


@pytest.mark.parametrize(
    "lengths, stock_ms, choice, replays",
    [
        ([10], STOCK_MS, PADDED, 1),  # bucket 16 at 1.0 ms against exact 5.0, stock 4.0; no pair under 1.0
        ([20, 20], STOCK_MS, PADDED, 1),  # bucket 64 at 2.0; the cheapest pair holding 40 rows (16 + 64) costs 3.0
        ([35, 35], STOCK_MS, STOCK, 0),  # bucket 128 at 10.0, exact ~6.1, stock 3.5; a cut (64 + 64 = 4.0) is dearer
        ([35, 35], {128: [(70, 9.0)]}, SPLIT, 2),  # exact ~6.1 the cheapest whole; cut after segment 1: 4.0
        ([35, 35], {}, SPLIT, 2),  # the same call, stock untimed but not offered past the first: 64 + 64 = 4.0
        ([70], {128: [(70, 9.0)]}, EXACT, 0),  # one segment cannot be cut; exact ~6.1 < stock 9.0 < replay 10.0
        ([70], STOCK_MS, STOCK, 0),  # stock 3.5 < exact ~6.1
    ],
)
def test_the_choice_follows_the_cost_table(model, routed, lengths, stock_ms, choice, replays):
    compiled, runtime = routed
    _table(runtime, stock_ms)
    inputs = pack_images(lengths, 12)
    if not stock_ms:  # the first two calls the bucket gets run the stock module, the second timed (the first: cold)
        for timed in (False, True):
            with torch.no_grad(), counters.expect(replays=0):
                torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
            assert (128 in runtime.stock_ms) is timed
        ((rows, ms),) = runtime.stock_ms[128]
        assert rows == 70 and ms > 0
        runtime.stock_ms[128] = [(70, 100.0)]
        runtime._routes.clear()
    before = runtime.choices.copy()
    with torch.no_grad(), counters.expect(replays=replays):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert runtime.choices - before == {choice: 1}
    assert f"{choice} x{runtime.choices[choice]}" in compiled.vgraph.runtimes[0].stats_table()


def test_stock_is_timed_again_for_rows_far_from_its_timings(routed):
    """A stock timing at 40 rows stands for 33..50 rows; 60 rows in the same bucket is timed afresh."""
    compiled, runtime = routed
    _table(runtime, {64: [(40, 0.5)]})
    with torch.no_grad():
        compiled(*pack_images([30, 30], 12))
    assert [rows for rows, _ in runtime.stock_ms[64]] == [40, 60]


@pytest.mark.parametrize("timed, choice", [({16: [(10, 50.0)]}, PADDED), ({128: [(100, 50.0)]}, STOCK)])
def test_stock_known_slower_on_fewer_rows_is_not_run_to_be_timed(model, routed, timed, choice):
    """The stock module took 50 ms on 10 rows (bucket 16): a 60-row call (bucket 64, untimed there, replay 2.0 ms)
    is padded, not run stock to be timed. A slow timing on more rows than the call's bounds nothing: the call runs
    the stock module (its bucket's first, cold call)."""
    compiled, runtime = routed
    _table(runtime, timed)
    inputs = pack_images([30, 30], 12)
    before = runtime.choices.copy()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert runtime.choices - before == {choice: 1}


@given(lengths=segments.filter(lambda lengths: sum(lengths) <= BUDGETS[-1]))
def test_every_choice_matches_eager_and_counts_its_replays(model, routed, lengths):
    """Whatever the table picks, the rows equal eager's (fp32, 1e-5, NaN never passes), a padded call replays one
    bucket, a split call two, an exact-size or stock call none."""
    compiled, runtime = routed
    _table(runtime, {budget: [(rows, ms * 1.6)] for budget, [(rows, ms)] in STOCK_MS.items()})
    inputs = pack_images(lengths, 12)
    before, replays = runtime.choices.copy(), counters.replays
    with torch.no_grad():
        out = compiled(*inputs)
    (choice,) = (runtime.choices - before).keys()
    assert counters.replays - replays == {PADDED: 1, SPLIT: 2, EXACT: 0, STOCK: 0}[choice]
    assert not out.isnan().any()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)


def test_kept_buckets_serve_and_a_released_runtime_runs_eagerly(model):
    """``keep_buckets`` (the buckets every rank of a group captured): a call its smallest bucket held before now
    takes the next kept one; ``release`` (graphs reset before a group is destroyed): calls run eagerly, equal."""
    compiled = vgraph_compile.encoder(model, token_budgets=BUDGETS, max_segments=6, compiler="eager")
    inputs = pack_images([3, 4], 12)  # 7 rows: the 16 bucket
    with torch.no_grad():
        compiled(*inputs)
        runtime = compiled.vgraph.runtimes[0]
        runtime.keep_buckets({64, 128})
        with counters.expect(replays=1):
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
        assert [(bucket.shape.budget, bucket.stats.hits) for bucket in runtime.buckets] == [(64, 1), (128, 0)]
        runtime.release()
        with counters.expect(eager_fallbacks=1):
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert runtime.buckets == []
