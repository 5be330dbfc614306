"""``vgraph::linear_gelu_tanh`` off CUDA: the unfused layer's values, its fake kernel's shape, dtype and strides
(``torch.library.opcheck``); the CUDA epilogue against the unfused layer is in ``tests/gpu/test_kernels.py``."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from vgraph_compile.kernels.gemm_epilogues import LINEAR_GELU_TANH, linear_gelu_tanh


@settings(max_examples=10, deadline=None)
@given(
    lead=st.lists(st.integers(0, 5), min_size=1, max_size=2),
    width=st.integers(1, 24),
    out=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_equals_the_linear_then_the_tanh_gelu(lead, width, out, dtype):
    """Any leading dims (rows, or tiles and rows; zero rows included), any widths: the unfused layer's values,
    bit for bit, in a fresh contiguous tensor of the input's dtype."""
    generator = torch.Generator().manual_seed(width * out)
    shapes = ((*lead, width), (out, width), (out,))
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in shapes)
    got = linear_gelu_tanh(x, weight, bias)
    expected = F.gelu(F.linear(x, weight, bias), approximate="tanh")
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_nan_stays_in_its_row():
    """A NaN in one input row makes that output row NaN and no other."""
    x, weight, bias = torch.randn(4, 6), torch.randn(5, 6), torch.randn(5)
    x[2, 3] = float("nan")
    out = linear_gelu_tanh(x, weight, bias)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (0, 16)])
def test_opcheck(shape):
    x = torch.randn(shape)
    opcheck(LINEAR_GELU_TANH.default, (x, torch.randn(12, 16), torch.randn(12)))
