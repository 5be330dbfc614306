"""``gelu_epilogues``: on CUDA, in bf16, each linear whose only user is its tanh GELU becomes one
``linear_gelu_tanh`` with the traced values at every row count; the exact GELU, a linear read twice, a bias-less
linear, float32 and any other device are left as they are. The pass is exercised on CPU tensors with a CUDA pass
context (the op's CPU path is the unfused layer); the CUDA epilogue's values are in ``tests/gpu/test_kernels.py``."""

import dataclasses

import pytest
import torch
from transformers.activations import ACT2FN

from tests.helpers import op_count, trace
from vgraph_compile.fx_utils import apply_pass
from vgraph_compile.kernels.gemm_epilogues import LINEAR_GELU_TANH
from vgraph_compile.rewrite import gelu_epilogues


class _Mlp(torch.nn.Module):
    """Qwen3-VL's and SigLIP's MLP (``gelu_pytorch_tanh``), and next to it the cases the pass must leave."""

    def __init__(self, width=16, inner=40):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, inner), torch.nn.Linear(inner, width)
        self.act = ACT2FN["gelu_pytorch_tanh"]
        self.exact = torch.nn.Linear(width, inner)
        self.no_bias = torch.nn.Linear(width, inner, bias=False)
        self.shared = torch.nn.Linear(width, inner)

    def forward(self, x):
        mlp = self.fc2(self.act(self.fc1(x)))
        exact = torch.nn.functional.gelu(self.exact(x))
        no_bias = torch.nn.functional.gelu(self.no_bias(x), approximate="tanh")
        shared = self.shared(x)
        both = torch.nn.functional.gelu(shared, approximate="tanh") + shared
        return mlp, exact + no_bias + both


def _rewritten(device_type: str, dtype=torch.bfloat16):
    torch.manual_seed(0)
    module = _Mlp().to(dtype).eval()
    with torch.no_grad():
        gm, ctx = trace(module, torch.randn(5, 16, dtype=dtype))
    ctx = dataclasses.replace(ctx, device=torch.device(device_type))
    return module, apply_pass("gelu_epilogues", gelu_epilogues.run, gm, ctx), ctx


def test_only_the_mlps_linear_and_gelu_fuse_and_the_values_are_the_traced_ones_at_every_row_count():
    module, gm, ctx = _rewritten("cuda")
    assert op_count(gm, LINEAR_GELU_TANH.default) == 1
    assert op_count(gm, torch._C._nn.gelu) == 3
    with torch.no_grad():
        for rows in (1, 3, 17):
            x = torch.randn(rows, 16, dtype=torch.bfloat16)
            inputs = [
                rows if not isinstance(value, torch.Tensor) else value if isinstance(value, torch.nn.Parameter) else x
                for value in ctx.example_inputs
            ]
            for got, expected in zip(gm(*inputs), module(x)):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "device_type, dtype", [("cpu", torch.bfloat16), ("meta", torch.bfloat16), ("cuda", torch.float32)]
)
def test_off_cuda_or_in_float32_nothing_changes(device_type, dtype):
    _, gm, _ = _rewritten(device_type, dtype)
    assert op_count(gm, LINEAR_GELU_TANH.default) == 0
    assert op_count(gm, torch._C._nn.gelu) == 4
