"""The bad-input matrix: each case raises a ValueError that names the argument and the fix, before any graph runs
(no bucket filled, no replay, no eager fallback). docs/encoders.md's "Bad input" table lists the same cases."""

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

torch.manual_seed(0)
MODEL = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
PATCHES, CU, MAX_SEQLEN = pack_images([5, 7], 12)

CASES = {
    # case: (arguments, the served encoder's message, the first call's message, or None where dynamo's own trace
    # of the model fails before vgraph sees a graph: a device mismatch, a matmul width, an int given a float)
    "int64 cu_seqlens": (
        (PATCHES, CU.long(), MAX_SEQLEN),
        r"cu_seqlens is torch.int64 on cpu, but .* compiled for torch.int32 on cpu: .*cu_seqlens.to\(",
        r"cu_seqlens input 'cu_seqlens' is torch.int64: .*cu_seqlens.to\(torch.int32\)",
    ),
    "float cu_seqlens": (
        (PATCHES, CU.float(), MAX_SEQLEN),
        r"cu_seqlens is torch.float32 on cpu, but .* compiled for torch.int32 on cpu",
        r"cu_seqlens input 'cu_seqlens' is torch.float32: .*cu_seqlens.to\(torch.int32\)",
    ),
    "2-D cu_seqlens": (
        (PATCHES, CU[None], MAX_SEQLEN),
        r"cu_seqlens has shape \(1, 3\), but the encoder takes \[any\]",
        r"cu_seqlens input 'cu_seqlens' is 2-D: it must be 1-D .*cu_seqlens.reshape\(-1\)",
    ),
    "cu_seqlens as a Python list": (
        (PATCHES, CU.tolist(), MAX_SEQLEN),
        r"cu_seqlens is a Python list of 3 ints .*cu_seqlens=torch.tensor\(cu_seqlens, dtype=torch.int32",
        r"cu_seqlens is a Python list of 3 ints .*cu_seqlens=torch.tensor\(cu_seqlens, dtype=torch.int32",
    ),
    "tokens on the meta device": (
        (PATCHES.to("meta"), CU, MAX_SEQLEN),
        r"patches is torch.float32 on meta, but .* on cpu: .*patches.to\(device='cpu'",
        None,
    ),
    "float64 tokens, float32 encoder": (
        (PATCHES.double(), CU, MAX_SEQLEN),
        r"patches is torch.float64 on cpu, but .* compiled for torch.float32 on cpu",
        r"input 'patches' is torch.float64 but meets parameters of torch.float32 .*patches.to\(torch.float32\)",
    ),
    "wrong trailing width": (
        (torch.randn(12, 10), CU, MAX_SEQLEN),
        r"patches has shape \(12, 10\), but the encoder takes \[any, 12\]",
        None,
    ),
    "non-integer max_seqlen": ((PATCHES, CU, 70.0), r"max_seqlen must be an int .*got 70.0", None),
    "max_seqlen under the longest segment": (
        (PATCHES, CU, 3),
        r"max_seqlen=3 is smaller than the longest segment of cu_seqlens \(7 rows\)",
        r"max_seqlen=3 is smaller than the longest segment of cu_seqlens \(7 rows\)",
    ),
    "decreasing cu_seqlens": (
        (PATCHES, torch.tensor([0, 7, 5, 12], dtype=torch.int32), 7),
        r"cu_seqlens must start at 0, never decrease and end at the row count 12; got \[0, 7, 5, 12\]",
        r"cu_seqlens must start at 0, never decrease and end at the row count 12; got \[0, 7, 5, 12\]",
    ),
}
FIRST_CALL = [case for case, (_, _, first_call) in CASES.items() if first_call is not None]
"""Cases caught on the first call too (at trace time, or by the first call's checks)."""


@pytest.fixture(scope="module")
def served():
    compiled = vgraph_compile.encoder(MODEL, token_budgets=(16, 64), max_segments=4, compiler="eager")
    with torch.no_grad():
        compiled(PATCHES, CU, MAX_SEQLEN)
    return compiled


@pytest.mark.parametrize("case", CASES)
def test_served_encoder_refuses_before_any_graph_runs(served, case):
    args, message, _ = CASES[case]
    with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
        served(*args)


@pytest.mark.parametrize("case", FIRST_CALL)
def test_first_call_refuses_before_anything_is_built(case):
    """Raised at trace time or by the first call's checks, before the compile and the buckets; a good call then
    builds, serves and takes the dynamo-free path."""
    torch._dynamo.reset()
    compiled = vgraph_compile.encoder(MODEL, token_budgets=(16, 64), max_segments=4, compiler="eager")
    args, _, message = CASES[case]
    built = counters.buckets_built
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        compiled(*args)
    assert counters.buckets_built == built
    with torch.no_grad():
        torch.testing.assert_close(compiled(PATCHES, CU, MAX_SEQLEN), MODEL(PATCHES, CU, MAX_SEQLEN))
    assert counters.buckets_built == built + 2 and compiled.traced
