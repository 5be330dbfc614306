"""On a CUDA GPU: bf16 bucket graphs through CUDA graph trees against an fp32 reference, a NaN-poisoned pool,
no re-record after warm-up, no allocation inside replay. Run with ``pytest -m gpu``."""

import random

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import PackedViT, pack_images
from vgraph_compile.runtime.cudagraph import recorded_graphs

pytestmark = pytest.mark.gpu

BUDGETS = (256, 1024)


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
    return vgraph_compile.encoder(models[1], token_budgets=BUDGETS, max_segments=8)


def _request(rng):
    return [4 * rng.randint(1, 64) for _ in range(rng.randint(1, 4))]


def test_bf16_matches_eager_against_fp32_reference(models, compiled):
    """vgraph (FA2 varlen in CUDA graphs) is as close to the fp32 model as eager bf16 is, on 30 random batches."""
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
    assert compiled.vgraph.runtimes[0].cudagraphs


def test_no_rerecord_and_no_allocation_in_replay(compiled):
    rng = random.Random(1)
    with torch.inference_mode():
        compiled(*pack_images([64], 588, device="cuda", dtype=torch.bfloat16))
        graphs = recorded_graphs()
        assert graphs >= len(BUDGETS)
        torch.cuda.synchronize()
        runtime = compiled.vgraph.runtimes[0]
        bucket = runtime.buckets[0]
        inputs = pack_images([64, 64], 588, device="cuda", dtype=torch.bfloat16)
        compiled(*inputs)
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        from vgraph_compile.runtime import cudagraph

        for _ in range(5):
            cudagraph.run_static(bucket.run, cudagraphs=True)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "replay allocated memory"
        with counters.expect(replays=50):
            for _ in range(50):
                compiled(*pack_images(_request(rng), 588, device="cuda", dtype=torch.bfloat16))
        assert recorded_graphs() == graphs, "a bucket was re-recorded after warm-up"
        assert len(compiled.vgraph.runtimes) == 1, "dynamo retraced"


def test_nan_poisoned_pool_and_buffers_never_reach_real_rows(models, compiled):
    """Fill the shared pool (run the big bucket on NaN input) and every persistent buffer with NaN first."""
    fp32, bf16 = models
    runtime = compiled.vgraph.runtimes[0]
    with torch.inference_mode():
        big, small = runtime.buckets[-1], runtime.buckets[0]
        for bucket in runtime.buckets:
            for buffer in bucket.buffers.values():
                buffer.fill_(float("nan") if buffer.is_floating_point() else 0)
        from vgraph_compile.runtime import cudagraph

        cudagraph.run_static(big.run, cudagraphs=True)
        for buffer in small.buffers.values():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        patches, cu, max_seqlen = pack_images([36, 100], 588, device="cuda")
        out = compiled(patches.bfloat16(), cu, max_seqlen)
        assert not out.isnan().any()
        assert _relative(out, fp32(patches, cu, max_seqlen)) < 2e-2
