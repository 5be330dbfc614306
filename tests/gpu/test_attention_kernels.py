"""On a CUDA GPU: every installed varlen kernel behind ``vgraph::varlen_attention`` in bf16 against a float64
reference, captured in a ``torch.cuda.CUDAGraph`` whose pool was filled with NaN, and replayed with new offsets
(empty segments and padding rows included). Run with ``pytest -m gpu``."""

import pytest
import torch

from tests.helpers import segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.kernels.segments import cu_seqlens

pytestmark = pytest.mark.gpu

KERNELS = [name for name, backend in registry.BACKENDS.items() if not backend.qkv_offsets and name != "sdpa"]
ROWS, SLOTS, HEADS = 1536, 6, 4


def _offsets(lengths):
    """int32 cu_seqlens of ``lengths`` padded to SLOTS segments by repeating the last offset (empty segments)."""
    lengths = list(lengths) + [0] * (SLOTS - len(lengths))
    return cu_seqlens(lengths, "cuda")


def _kernel(name):
    reason = registry.BACKENDS[name].unavailable(torch.device("cuda"), torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    return lambda q, k, v, cu: varlen_attention(q, k, v, cu, ROWS, backend=name)


def _relative(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def _poisoned_pool():
    """A graph pool whose free blocks hold NaN: a captured graph filled a large buffer with NaN and let it go."""
    pool = torch.cuda.graph_pool_handle()
    poison = torch.cuda.CUDAGraph()
    with torch.cuda.graph(poison, pool=pool):
        buffer = torch.full((64 * ROWS, HEADS, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    poison.replay()
    del buffer
    return pool, poison


@pytest.mark.parametrize("head_dim", [80, 72])
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_in_poisoned_graph_matches_float64_reference(name, head_dim):
    """Real rows match the float64 reference to bf16 accuracy; padding rows and the rows of empty
    segments come out exactly zero, after replays with offsets other than the captured ones."""
    kernel = _kernel(name)
    torch.manual_seed(0)
    q, k, v = (torch.randn(ROWS, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = _offsets([700, 0, 500])
    kernel(q, k, v, cu)  # warm-up: JIT and plans, outside the capture
    torch.cuda.synchronize()
    pool, poison = _poisoned_pool()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = kernel(q, k, v, cu)
    for lengths in ([700, 0, 500], [64, 1000, 0, 8, 300], [1536], []):
        cu.copy_(_offsets(lengths))
        graph.replay()
        torch.cuda.synchronize()
        ref = segment_reference(q, k, v, cu)
        end = sum(lengths)
        assert torch.equal(out[end:], torch.zeros_like(out[end:])), f"rows past {end} are not zero"
        assert not out.isnan().any()
        if end:
            assert _relative(out[:end], ref[:end]) < 1e-2  # bf16 rounding of q/k/v and output: ~4e-3
    del poison


@pytest.mark.parametrize("name", KERNELS)
def test_strided_qkv_views(name):
    """q/k/v as views of one fused qkv tensor (rows 3x apart) give the reference result."""
    kernel = _kernel(name)
    qkv = torch.randn(600, 3, HEADS, 80, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    cu = _offsets([250, 350])
    out = kernel(q, k, v, cu)
    ref = segment_reference(q, k, v, cu)
    assert _relative(out, ref) < 1e-2
