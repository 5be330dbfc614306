"""The Triton confinement and epilogue on a CUDA GPU (``segments.confine_nonfinite`` and ``finish_output`` there)
against their torch reference, plain and replayed in a CUDA graph; marked ``gpu``, run with ``pytest -m gpu``. Its
index arithmetic is tested on the CPU in ``test_confine_indexing.py``."""

import pytest
import torch
from hypothesis import given

from tests.kernels.test_segments import check_finished, confinement_cases
from vgraph_compile.kernels.segments import (
    confine_nonfinite,
    confine_nonfinite_reference,
    finish_output,
    finish_output_reference,
)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _on_cuda(case, dtype, strided):
    """A confinement case on CUDA in ``dtype``; ``strided``: k and v as views of one fused [rows, 3, heads, dim]."""
    k, v, cu = case
    if strided:
        fused = torch.empty(k.shape[0], 3, *k.shape[1:], device=CUDA, dtype=dtype)
        fused[:, 1], fused[:, 2] = k, v
        return fused[:, 1], fused[:, 2], cu.to(CUDA)
    return k.to(CUDA, dtype), v.to(CUDA, dtype), cu.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
@given(case=confinement_cases())
def test_triton_confinement_equals_the_torch_reference(dtype, strided, case):
    """Zeroed k/v bit for bit, the same poisoned flags, and the same finished output (NaN in the same places,
    padding rows zero, every other entry unchanged), with flags and without."""
    k, v, cu = _on_cuda(case, dtype, strided)
    if k.shape[0] == 0:
        return
    confined_k, confined_v, poisoned = confine_nonfinite(k, v, cu)
    expected_k, expected_v, expected_poisoned = confine_nonfinite_reference(k, v, cu)
    assert torch.equal(confined_k, expected_k) and torch.equal(confined_v, expected_v)
    assert torch.equal(poisoned.bool(), expected_poisoned)
    out = torch.randn(k.shape, device=CUDA, dtype=dtype)
    out[int(cu[-1]) :] = float("nan")
    for flags, expected_flags in ((poisoned, expected_poisoned), (None, None)):
        expected = finish_output_reference(out, cu, expected_flags)
        finished = finish_output(out.clone(), cu, flags)
        assert torch.equal(finished.isnan(), expected.isnan())
        assert torch.equal(finished.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_triton_confinement_replays_in_a_cuda_graph():
    """Captured once, replayed with new offsets and new NaN/Inf positions (padding rows included): each replay
    equals the reference on the replay's inputs (the flags are reset inside the graph; nothing is decided on the
    host, and the epilogue's skip on clean input is decided on the device)."""
    rows, heads, head_dim = 2048, 4, 72
    k, v = (torch.randn(rows, heads, head_dim, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 700, 700, 1900], device=CUDA, dtype=torch.int32)
    out = torch.randn(rows, heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    confine_nonfinite(k, v, cu)  # compile outside the capture
    finish_output(out.clone(), cu, torch.zeros(4, heads, device=CUDA, dtype=torch.int32))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        confined_k, confined_v, poisoned = confine_nonfinite(k, v, cu)
        finished = finish_output(out.clone(), cu, poisoned)
    for offsets, planted in (
        ([0, 700, 700, 1900], [(1, 5, 1, float("nan"))]),
        ([0, 64, 1000, 1008], [(0, 1003, 3, float("inf")), (1, 2000, 0, float("nan"))]),
        ([0, 2048, 2048, 2048], []),
        ([0, 100, 200, 300], [(1, 1500, 2, float("nan"))]),
        ([0, 0, 0, 0], [(0, 10, 2, float("-inf"))]),
    ):
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        for tensor, row, head, value in planted:
            (k, v)[tensor][row, head, row % head_dim] = value
        graph.replay()
        expected_k, expected_v, expected_poisoned = confine_nonfinite_reference(k, v, cu)
        assert torch.equal(confined_k, expected_k) and torch.equal(confined_v, expected_v)
        assert torch.equal(poisoned.bool(), expected_poisoned)
        check_finished(finished, out, cu, expected_poisoned)
