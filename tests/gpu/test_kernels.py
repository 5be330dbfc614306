"""On a CUDA GPU, every attention kernel that runs there: equality against a float64 reference at the towers' head
dims, and isolation of NaN/Inf per segment. Run with ``pytest -m gpu``."""

import pytest
import torch
from hypothesis import given

from tests.kernels.test_segments import check_isolation, poisoned_calls
from tests.helpers import run_backend, segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import cu_seqlens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16_TOLERANCE = dict(rtol=2e-2, atol=2e-2)
KERNELS = [(name, dtype) for name in registry.BACKENDS for dtype in (torch.bfloat16, torch.float32)]


def _require(name, dtype):
    reason = registry.BACKENDS[name].unavailable(CUDA, dtype)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("name", list(registry.BACKENDS))
@pytest.mark.parametrize(
    "dtype, head_dim",
    [(torch.bfloat16, 64), (torch.bfloat16, 72), (torch.bfloat16, 80), (torch.float32, 80)],
)
def test_kernel_matches_float64_reference(name, dtype, head_dim):
    """Segments of 1, 0, 300, 129, 2000 and 7 rows plus 1659 padding rows (NaN): real rows within bf16 (fp32)
    rounding of the reference, padding rows exactly zero."""
    _require(name, dtype)
    lengths = [1, 0, 300, 129, 2000, 7]
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(4096, 4, head_dim, generator=generator).to(CUDA, dtype) for _ in range(3))
    cu = cu_seqlens(lengths, CUDA)
    end = sum(lengths)
    for t in (q, k, v):
        t[end:] = float("nan")
    out = run_backend(name, q, k, v, cu, max(lengths))
    reference = segment_reference(*(t[:end].cpu() for t in (q, k, v)), cu.cpu())
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:end].double().cpu(), reference, **tolerance)
    assert out[end:].eq(0).all()


@pytest.mark.parametrize("name, dtype", KERNELS)
@given(call=poisoned_calls())
def test_nonfinite_values_stay_in_their_segment_on_cuda(name, dtype, call):
    """As on the CPU; every call padded to 4 segments and 600 rows, so a compiling kernel compiles once."""
    _require(name, dtype)
    lengths, padding, *poison = call
    lengths = lengths + [0] * (4 - len(lengths))
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    check_isolation(name, (lengths, 600 - sum(lengths), *poison), dtype, "cuda", tolerance)
