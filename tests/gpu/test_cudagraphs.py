"""On a CUDA GPU: bf16 buckets captured as CUDA graphs against an fp32 reference, a NaN-poisoned pool and buffers,
no re-record and no allocation in replay, one compile for every bucket, callers on several streams and threads.
Run with ``pytest -m gpu``."""

import concurrent.futures
import random

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

pytestmark = pytest.mark.gpu

BUDGETS = (256, 512, 1024)


def _relative(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    fp32 = PackedViT(patch_dim=588, dim=256, depth=4, heads=4, out_dim=512, merge=4).cuda().eval()
    bf16 = PackedViT(patch_dim=588, dim=256, depth=4, heads=4, out_dim=512, merge=4).cuda().eval()
    bf16.load_state_dict(fp32.state_dict())
    return fp32, bf16.to(torch.bfloat16)


@pytest.fixture(scope="module")
def compiled(models):
    """Warmed up at the first call (``captures="first_call"``): one trace, one inductor compile (the 4 identical
    blocks as calls of one subgraph), one captured graph per budget, then the call replayed."""
    compiled = vgraph_compile.encoder(
        models[1], token_budgets=BUDGETS, max_segments=8, call_choice="smallest_bucket", captures="first_call"
    )
    with (
        torch.inference_mode(),
        counters.expect(
            traces=1, sites_found=4, nodes_rewritten=8, compiles=1, blocks_compiled_once=4, buckets_built=3,
            graphs_captured=3, graphs_uploaded=3, replays=1,
        ),
    ):
        compiled(*pack_images([64], 588, device="cuda", dtype=torch.bfloat16))
    return compiled


def _request(rng):
    return [4 * rng.randint(1, 64) for _ in range(rng.randint(1, 4))]


def test_bf16_matches_eager_against_fp32_reference(models, compiled):
    """vgraph in CUDA graphs is as close to the fp32 model as eager bf16 is, on 30 random batches."""
    fp32, bf16 = models
    rng = random.Random(0)
    with torch.inference_mode():
        for _ in range(30):
            patches, cu, max_seqlen = pack_images(_request(rng), 588, device="cuda")
            ref = fp32(patches, cu, max_seqlen)
            eager = bf16(patches.bfloat16(), cu, max_seqlen)
            out = compiled(patches.bfloat16(), cu, max_seqlen)
            assert not out.isnan().any()
            assert _relative(out, ref) < max(2 * _relative(eager, ref), 1e-2)
    runtime = compiled.vgraph.runtimes[0]
    assert all(bucket.graph is not None for bucket in runtime.buckets)


def test_no_rerecord_and_no_allocation_in_replay(compiled):
    """50 random batches: replays only (no capture, compile or trace); a replay allocates nothing."""
    rng = random.Random(1)
    runtime = compiled.vgraph.runtimes[0]
    with torch.inference_mode():
        bucket = runtime.buckets[0]
        torch.cuda.synchronize()
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(5):
            bucket.graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "replay allocated memory"
        with counters.expect(replays=50):
            for _ in range(50):
                compiled(*pack_images(_request(rng), 588, device="cuda", dtype=torch.bfloat16))
    assert len(compiled.vgraph.runtimes) == 1, "dynamo retraced"


def test_nan_poisoned_pool_and_buffers_never_reach_real_rows(models, compiled):
    """Run the largest graph on NaN input (its intermediates fill the shared pool), NaN every buffer, then serve
    a small call: its real rows are finite and match the fp32 model."""
    fp32, _ = models
    runtime = compiled.vgraph.runtimes[0]
    with torch.inference_mode():
        for bucket in runtime.buckets:
            for buffer in bucket.buffers.values():
                buffer.fill_(float("nan") if buffer.is_floating_point() else 0)
        runtime.buckets[-1].graph.replay()
        for buffer in runtime.buckets[0].buffers.values():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        patches, cu, max_seqlen = pack_images([36, 100], 588, device="cuda")
        out = compiled(patches.bfloat16(), cu, max_seqlen)
        assert not out.isnan().any()
        assert _relative(out, fp32(patches, cu, max_seqlen)) < 2e-2


def test_threads_on_their_own_streams(models, compiled):
    """4 threads, each on its own CUDA stream, 20 calls each: every result equals eager bf16 on that stream."""
    _, bf16 = models

    def worker(seed):
        rng = random.Random(seed)
        stream = torch.cuda.Stream()
        worst = 0.0
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(20):
                inputs = pack_images(_request(rng), 588, device="cuda", dtype=torch.bfloat16)
                out = compiled(*inputs)
                worst = max(worst, _relative(out, bf16(*inputs)))
        stream.synchronize()
        return worst

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert max(pool.map(worker, range(4))) < 1e-2


def test_results_are_not_overwritten_by_later_replays(models, compiled):
    """Two calls of the same sizes (one bucket, the same cached narrowed views) with different pixels: the first
    call's result, read after the second replay, still equals eager on its own input and shares no memory with
    the graph's static outputs."""
    _, bf16 = models
    runtime = compiled.vgraph.runtimes[0]
    with torch.inference_mode():
        first = pack_images([36, 100], 588, device="cuda", dtype=torch.bfloat16)
        second = (torch.randn_like(first[0]), *first[1:])
        with counters.expect(replays=2):
            out_first = compiled(*first)
            out_second = compiled(*second)
        torch.cuda.synchronize()
        statics = {
            output.untyped_storage().data_ptr()
            for bucket in runtime.buckets
            for output in bucket.outputs
            if isinstance(output, torch.Tensor)
        }
        assert out_first.untyped_storage().data_ptr() not in statics
        assert _relative(out_first, bf16(*first)) < 1e-2
        assert _relative(out_second, bf16(*second)) < 1e-2
        assert not torch.equal(out_first, out_second)


def test_calls_are_served_while_the_graphs_are_captured_behind(models):
    """The default ``captures="behind"``: the first call is served before its bucket's graph exists, the calls that
    follow run between the captures (the compiled code at their sizes, or a replay once captured), each equal to
    eager bf16 on the fp32 reference's terms; ``warmup()`` returns with every bucket captured, and later calls
    replay."""
    fp32, bf16 = models
    torch.manual_seed(0)
    model = PackedViT(patch_dim=588, dim=256, depth=4, heads=4, out_dim=512, merge=4).cuda().eval()
    model.load_state_dict(fp32.state_dict())
    compiled = vgraph_compile.encoder(
        model.to(torch.bfloat16), token_budgets=(256, 512, 1024, 2048), max_segments=8,
        call_choice="smallest_bucket",
    )  # fmt: skip
    rng = random.Random(3)

    def check(lengths):
        inputs = pack_images(lengths, 588, device="cuda", dtype=torch.bfloat16)
        out = compiled(*inputs)
        assert not out.isnan().any()
        assert _relative(out, bf16(*inputs)) < 1e-2

    with torch.inference_mode():
        before = counters.snapshot()
        for lengths in [[64], *(_request(rng) for _ in range(30))]:
            check(lengths)
        runtime = compiled.vgraph.runtimes[0]
        assert counters.served_before_capture > before["served_before_capture"]
        runtime.warmup()
        assert runtime.encoder.captured and all(bucket.graph is not None for bucket in runtime.buckets)
        assert counters.graphs_captured - before["graphs_captured"] == 4
        with counters.expect(replays=10):
            for _ in range(10):
                check(_request(rng))
