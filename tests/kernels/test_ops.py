import dataclasses
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

from tests.helpers import segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import cu_seqlens
from vgraph_compile.kernels.ops import VARLEN_ATTENTION, qkv_offsets_varlen_attention, varlen_attention

segment_lists = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6)


def _packed(lengths, padding=0, heads=2, head_dim=8, generator=None):
    rows = sum(lengths) + padding
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator) for _ in range(3))
    cu = cu_seqlens(lengths)
    return q, k, v, cu


@given(lengths=segment_lists, padding=st.integers(0, 16), scale=st.sampled_from([None, 0.3]))
def test_sdpa_matches_per_segment_reference(lengths, padding, scale):
    """Real rows equal per-segment attention; rows past the last offset are exactly zero."""
    if sum(lengths) + padding == 0:
        padding = 1
    q, k, v, cu = _packed(lengths, padding)
    out = varlen_attention(q, k, v, cu, max(lengths), scale=scale, backend="sdpa")
    torch.testing.assert_close(out.double(), segment_reference(q, k, v, cu, scale), rtol=1e-5, atol=1e-5)
    assert not out.isnan().any()


def test_padded_rows_never_leak_into_real_rows():
    """NaN in padded rows of q/k/v (what an unwritten pool can hold) changes no real row."""
    q, k, v, cu = _packed([5, 7], padding=4)
    clean = varlen_attention(q, k, v, cu, 7, backend="sdpa")
    for t in (q, k, v):
        t[12:] = float("nan")
    poisoned = varlen_attention(q, k, v, cu, 7, backend="sdpa")
    torch.testing.assert_close(poisoned[:12], clean[:12], rtol=0, atol=0)
    assert torch.equal(poisoned[12:], torch.zeros_like(poisoned[12:]))


def test_strided_views_as_inputs():
    """q/k/v as views of a fused qkv projection (the layout encoders produce) give the reference result."""
    qkv = torch.randn(20, 3, 2, 8)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 6, 20], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 14)
    torch.testing.assert_close(out.double(), segment_reference(q, k, v, cu), rtol=1e-5, atol=1e-5)


CPU_KERNELS = [
    name
    for name, backend in registry.BACKENDS.items()
    if not backend.qkv_offsets and backend.available(torch.device("cpu"), torch.float32)
]


@pytest.mark.parametrize(
    "backend", [*CPU_KERNELS, registry.by_rows({8: "sdpa", 16: "flex"}, {8: "dense_flash", 16: "sdpa"})]
)
@pytest.mark.parametrize("lengths, padding", [([3, 5], 2), ([10], 0), ([4], 6)])
def test_opcheck(backend, lengths, padding):
    """Every kernel that runs on the CPU, and a per-bucket choice with one-segment entries, returns what the fake
    kernel promises (shape, dtype, strides) under ``torch.library.opcheck``; the GPU tests check the CUDA ones."""
    q, k, v, cu = _packed(lengths, padding)
    opcheck(VARLEN_ATTENTION.default, (q, k, v, cu, max(lengths), None, backend))


def test_packed_op_opcheck():
    q, k, v, _ = _packed([3, 5], padding=2)
    row = q.shape[1] * q.shape[2]
    offsets = torch.tensor([0, 3 * row, 8 * row, 0, 3 * row, 8 * row], dtype=torch.int32)
    opcheck(qkv_offsets_varlen_attention, (q, k, v, offsets, 5))


def test_packed_op_refuses_strided_q_and_token_op_refuses_packed_backends():
    q, k, v = torch.randn(4, 3, 2, 8).unbind(1)
    packed = torch.tensor([0, 64, 0, 192], dtype=torch.int32)
    with pytest.raises(ValueError, match="q and k need contiguous rows"):
        qkv_offsets_varlen_attention(q, k, v, packed, 4)
    with pytest.raises(ValueError, match="reads packed"):
        varlen_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32), 4, backend="qkv_offsets_reference")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_head_dim_padding_is_exact(monkeypatch, dtype, tolerance, scale):
    """A kernel declaring head_dims (16, 32) runs head_dim 12 zero-padded to 16 and 24 to 32: the sliced output
    equals the unpadded kernel's, with the original head_dim's softmax scale."""
    sdpa = registry.BACKENDS["sdpa"]
    for head_dim in (12, 16, 24):
        q, k, v = torch.randn(30, 3, 2, head_dim, dtype=dtype).unbind(1)
        cu = torch.tensor([0, 7, 7, 26], dtype=torch.int32)
        unpadded = varlen_attention(q, k, v, cu, 19, scale=scale, backend="sdpa")
        monkeypatch.setitem(registry.BACKENDS, "sdpa", dataclasses.replace(sdpa, head_dims=(16, 32)))
        padded = varlen_attention(q, k, v, cu, 19, scale=scale, backend="sdpa")
        monkeypatch.setitem(registry.BACKENDS, "sdpa", sdpa)
        assert padded.shape == q.shape and padded.is_contiguous()
        torch.testing.assert_close(padded, unpadded, rtol=tolerance, atol=tolerance)
        assert padded[26:].eq(0).all()


def test_offsets_as_a_python_list_are_refused_by_name():
    """cu_seqlens given as a list of offsets: a ValueError naming it and the conversion, in eager code as in a
    trace (where plain torch.compile stops at it), not the op schema's cast error."""
    q, k, v, cu = _packed([5, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 tensor .*got a list; pass torch.tensor"):
        varlen_attention(q, k, v, cu.tolist(), 7)
    compiled = torch.compile(varlen_attention, backend="eager", dynamic=True)
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 tensor .*got a list"):
        compiled(q, k, v, cu.tolist(), 7)
