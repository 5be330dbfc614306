"""The bad-input matrix: each case raises a ValueError that names the argument and the fix, before any graph runs
(no bucket filled, no replay, no eager fallback). README.md's "Bad input" table lists the same cases."""

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import PackedViT, pack_images

torch.manual_seed(0)
MODEL = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
PATCHES, CU, MAX_SEQLEN = pack_images([5, 7], 12)

CASES = {
    "int64 cu_seqlens": ((PATCHES, CU.long(), MAX_SEQLEN), r"cu_seqlens.*torch.int64.*torch.int32"),
    "float cu_seqlens": ((PATCHES, CU.float(), MAX_SEQLEN), r"cu_seqlens.*torch.float32.*torch.int32"),
    "2-D cu_seqlens": ((PATCHES, CU[None], MAX_SEQLEN), r"cu_seqlens"),
    "tokens on the meta device": ((PATCHES.to("meta"), CU, MAX_SEQLEN), r"patches is torch.float32 on meta"),
    "float64 tokens, float32 encoder": ((PATCHES.double(), CU, MAX_SEQLEN), r"patches.*torch.float64"),
    "wrong trailing width": ((torch.randn(12, 10), CU, MAX_SEQLEN), r"patches has shape \(12, 10\).*\[any, 12\]"),
    "non-integer max_seqlen": ((PATCHES, CU, 70.0), r"max_seqlen must be an int.*70.0"),
    "max_seqlen under the longest segment": ((PATCHES, CU, 3), r"max_seqlen=3 is smaller than the longest segment"),
    "decreasing cu_seqlens": ((PATCHES, torch.tensor([0, 7, 5, 12], dtype=torch.int32), 7), r"never decrease"),
}
FIRST_CALL = {
    "int64 cu_seqlens",
    "float cu_seqlens",
    "2-D cu_seqlens",
    "float64 tokens, float32 encoder",
    "max_seqlen under the longest segment",
    "decreasing cu_seqlens",
}
"""Cases caught on the first call too (at trace time); the others fail inside dynamo's own trace of the model
before vgraph sees a graph (a device mismatch, a matmul width, an int argument given a float)."""


@pytest.fixture(scope="module")
def served():
    compiled = vgraph_compile.encoder(MODEL, token_budgets=(16, 64), max_segments=4, compiler="eager")
    with torch.no_grad():
        compiled(PATCHES, CU, MAX_SEQLEN)
    return compiled


@pytest.mark.parametrize("case", CASES)
def test_served_encoder_refuses_before_any_graph_runs(served, case):
    args, message = CASES[case]
    with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
        served(*args)


@pytest.mark.parametrize("case", sorted(FIRST_CALL))
def test_first_call_refuses_before_anything_is_built(case):
    """Raised at trace time or by the first call's checks, before the compile and the buckets; a good call then
    builds, serves and takes the dynamo-free path."""
    torch._dynamo.reset()
    compiled = vgraph_compile.encoder(MODEL, token_budgets=(16, 64), max_segments=4, compiler="eager")
    args, _ = CASES[case]
    built = counters.buckets_built
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seqlens|patches|max_seqlen"):
        compiled(*args)
    assert counters.buckets_built == built
    with torch.no_grad():
        torch.testing.assert_close(compiled(PATCHES, CU, MAX_SEQLEN), MODEL(PATCHES, CU, MAX_SEQLEN))
    assert counters.buckets_built == built + 2 and compiled.traced
