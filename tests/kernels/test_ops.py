import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

from tests.helpers import segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import cu_seqlens
from vgraph_compile.kernels.ops import VARLEN_ATTENTION, packed_varlen_attention, varlen_attention

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


def test_opcheck():
    q, k, v, cu = _packed([3, 5], padding=2)
    opcheck(VARLEN_ATTENTION.default, (q, k, v, cu, 5, None, "sdpa"))


def test_resolve_rejects_unknown_and_unsupported_backends():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        registry.resolve("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="'torch_varlen' cannot run on cpu"):
        registry.resolve("torch_varlen", torch.device("cpu"), torch.bfloat16)
    assert registry.resolve("default", torch.device("cpu"), torch.bfloat16).name == "sdpa"


@given(lengths=segment_lists, padding=st.integers(0, 8))
def test_packed_reference_reads_element_offsets_like_the_kernel(lengths, padding):
    """Q/K/O offsets count heads*head_dim per row, V offsets the fused qkv stride (3x): real rows equal the
    per-segment reference, rows past the last offset are zero."""
    if sum(lengths) + padding == 0:
        padding = 1
    rows = sum(lengths) + padding
    q, k, v = torch.randn(rows, 3, 2, 8).unbind(1)
    cu = _packed(lengths)[3]
    packed = torch.cat([cu * 16, cu * v.stride(0)])
    out = packed_varlen_attention(q.contiguous(), k.contiguous(), v, packed, max(lengths))
    torch.testing.assert_close(out.double(), segment_reference(q, k, v, cu), rtol=1e-5, atol=1e-5)


def test_packed_op_refuses_strided_q_and_token_op_refuses_packed_backends():
    q, k, v = torch.randn(4, 3, 2, 8).unbind(1)
    packed = torch.tensor([0, 64, 0, 192], dtype=torch.int32)
    with pytest.raises(ValueError, match="q and k need contiguous rows"):
        packed_varlen_attention(q, k, v, packed, 4)
    with pytest.raises(ValueError, match="reads packed"):
        varlen_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32), 4, backend="packed_reference")


@pytest.mark.parametrize(
    "name, module, package",
    [
        ("cudnn", "cudnn", "nvidia-cudnn-frontend"),
        ("flashinfer", "flashinfer", "flashinfer-python"),
        ("fa4", "flash_attn", "flash-attn-4"),
    ],
)
def test_missing_optional_kernel_names_its_pip_package(name, module, package):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(ValueError, match=f"needs the optional package {package}: pip install {package}"):
        registry.resolve(name, torch.device("cuda"), torch.bfloat16)


def test_cudnn_backend_is_registered_and_validates_head_dim():
    """``cudnn`` is a config-level kernel name; a head dim cuDNN cannot take is padded to one it can, or refused
    with the fix."""
    from typing import get_args

    from vgraph_compile.config import VGraphConfig

    assert "cudnn" in registry.BACKENDS and "cudnn" in get_args(registry.AttentionBackendName)
    assert VGraphConfig(attention_backend="cudnn").attention_backend == "cudnn"
    backend = registry.BACKENDS["cudnn"]
    assert (backend.padded_head_dim(72), backend.padded_head_dim(70)) == (72, 72)  # the op pads 70 to 72
    with pytest.raises(ValueError, match="'cudnn' runs head_dim up to 128, got 136: choose another"):
        backend.padded_head_dim(136)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_head_dim_padding_is_exact(monkeypatch, dtype, tolerance, scale):
    """A kernel declaring head_dims (16, 32) runs head_dim 12 zero-padded to 16 and 24 to 32: the sliced output
    equals the unpadded kernel's, with the original head_dim's softmax scale."""
    padding_sdpa = registry.AttentionBackend("sdpa_at_16_32", "sdpa", lambda d, t: True, head_dims=(16, 32))
    monkeypatch.setitem(registry.BACKENDS, padding_sdpa.name, padding_sdpa)
    for head_dim in (12, 16, 24):
        q, k, v = torch.randn(30, 3, 2, head_dim, dtype=dtype).unbind(1)
        cu = torch.tensor([0, 7, 7, 26], dtype=torch.int32)
        padded = varlen_attention(q, k, v, cu, 19, scale=scale, backend="sdpa_at_16_32")
        assert padded.shape == q.shape and padded.is_contiguous()
        unpadded = varlen_attention(q, k, v, cu, 19, scale=scale, backend="sdpa")
        torch.testing.assert_close(padded, unpadded, rtol=tolerance, atol=tolerance)
        assert padded[26:].eq(0).all()


def test_head_dims_refuse_wider_heads_and_packed_kernels():
    backend = registry.AttentionBackend("narrow", "sdpa", lambda d, t: True, head_dims=(64, 80, 128))
    assert [backend.padded_head_dim(d) for d in (40, 72, 80, 96)] == [64, 80, 80, 128]
    with pytest.raises(ValueError, match="'narrow' runs head_dim up to 128, got 256: choose another"):
        backend.padded_head_dim(256)
    with pytest.raises(ValueError, match="packed kernel cannot declare head_dims"):
        registry.AttentionBackend("p", "packed_reference", lambda d, t: True, packed=True, head_dims=(64,))


def test_offsets_as_a_python_list_are_refused_by_name():
    """cu_seqlens given as a list of offsets: a ValueError naming it and the conversion, in eager code as in a
    trace (where plain torch.compile stops at it), not the op schema's cast error."""
    q, k, v, cu = _packed([5, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 tensor .*got a list; pass torch.tensor"):
        varlen_attention(q, k, v, cu.tolist(), 7)
    compiled = torch.compile(varlen_attention, backend="eager", dynamic=True)
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 tensor .*got a list"):
        compiled(q, k, v, cu.tolist(), 7)
