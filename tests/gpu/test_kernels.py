"""On a CUDA GPU, every installed attention kernel: FlexAttention captured in a CUDA graph (NaN-poisoned pool)
replaying new offsets with no recompile, equality against a float64 reference at the towers' head dims, and
isolation of NaN/Inf per segment. Run with ``pytest -m gpu``. Few shapes per kernel: each dtype and head_dim is
one flex compile, under dynamo's recompile limit of 8."""

import pytest
import torch
from hypothesis import given

from tests.backends.test_segments import check_isolation, poisoned_calls
from tests.helpers import run_backend, segment_reference
from vgraph_compile import backends
from vgraph_compile.ops import varlen_attention

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16_TOLERANCE = dict(rtol=2e-2, atol=2e-2)
KERNELS = [(name, dtype) for name in backends.BACKENDS for dtype in (torch.bfloat16, torch.float32)]


def _require(name, dtype):
    try:
        backends.resolve(name, CUDA, dtype)
    except ValueError as unavailable:
        pytest.skip(str(unavailable))


def test_flex_in_a_cuda_graph_replays_new_offsets_without_recompiling():
    """``torch.compile(fullgraph=True)`` around the op, warmed up, then captured in a ``torch.cuda.CUDAGraph``
    whose pool was filled with NaN by an earlier graph: each replay on new offsets (empty segments, a padding tail)
    matches the reference, keeps padding rows zero, and compiles nothing."""
    rows, heads, head_dim = 2048, 8, 80
    static = [torch.zeros(rows, heads, head_dim, device=CUDA, dtype=torch.bfloat16) for _ in range(3)]
    cu = torch.zeros(9, device=CUDA, dtype=torch.int32)

    @torch.compile(fullgraph=True)
    def attend(q, k, v, cu_seqlens):
        return varlen_attention(q, k, v, cu_seqlens, rows, backend="flex") * 1

    def load(lengths, seed):
        generator = torch.Generator().manual_seed(seed)
        for t in static:
            t.copy_(torch.randn(rows, heads, head_dim, generator=generator))
        offsets = torch.tensor(lengths + [0] * (8 - len(lengths))).cumsum(0)
        cu.copy_(torch.nn.functional.pad(offsets, (1, 0)))
        return int(offsets[-1])

    load([100, 900], 0)
    for _ in range(3):
        attend(*static, cu)
    torch.cuda.synchronize()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    poison = torch.cuda.CUDAGraph()
    with torch.cuda.graph(poison):
        junk = torch.full((64 * rows * heads * head_dim,), float("nan"), device=CUDA, dtype=torch.bfloat16)
    poison.replay()
    del junk
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=poison.pool()):
        out = attend(*static, cu)

    for seed, lengths in enumerate([[5, 0, 2000], [1] * 8, [0, 0, 0, 2048], [129, 0, 127, 1, 700], []]):
        end = load(lengths, seed)
        graph.replay()
        torch.cuda.synchronize()
        reference = segment_reference(*(t[:end].cpu() for t in static), cu.cpu())
        torch.testing.assert_close(out[:end].double().cpu(), reference, **BF16_TOLERANCE)
        assert out[end:].eq(0).all(), f"padding rows of {lengths} not zero"
    attend(*static, cu)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "new offsets recompiled"


@pytest.mark.parametrize("name", list(backends.BACKENDS))
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
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(CUDA, torch.int32)
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
