"""``vgraph::linear_gelu_tanh``: a linear layer and the tanh GELU after it, the GELU in the GEMM's epilogue.

A ViT's MLP runs ``fc2(gelu(fc1(x), approximate="tanh"))`` (Qwen3-VL's and SigLIP's ``gelu_pytorch_tanh``). Apart,
the GELU is one more pass over the ``[rows, intermediate]`` activation, written by the GEMM and read back: on an
H200 it took 64 us of Qwen3-VL's 1x1344^2 layer beside 387 us of GEMMs (``benchmarks/results/
roofline_h200_cuda_2026-11-28_first.json``; gone from the later run's profile, ``roofline_h200_cuda.json``).
cuBLASLt applies the tanh GELU to the accumulator before it stores the output (``CUBLASLT_EPILOGUE_GELU_BIAS``),
which torch reaches through ``torch._addmm_activation(..., use_gelu=True)``.

Invariants:
- on CUDA it is ``torch._addmm_activation(bias, x, weight.T, use_gelu=True)`` over ``x``'s rows: the tanh GELU of
  the linear's fp32 accumulator plus the bias, rounded once to the output dtype (apart, the linear's output is
  rounded first: the two differ by at most about one rounding of the output's dtype); where cuBLASLt cannot take
  the shapes, torch runs the GEMM and the tanh GELU apart, with the same values as the unfused layer;
- ``rewrite/gelu_epilogues`` uses it in fp16 and bf16 only: on an H200 the float32 test against the unfused layer
  failed at 1 and 7 rows (the cause not yet read: the run's traceback was cut);
- elsewhere it is ``gelu(linear(x, weight, bias), approximate="tanh")`` (torch's CPU ``_addmm_activation``
  applies the exact GELU, not the tanh one, so it is not used there);
- the output is a fresh contiguous ``[*x.shape[:-1], weight.shape[0]]`` tensor of ``x``'s dtype;
- no host synchronisation: the op runs inside captured CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_gelu_tanh", "LINEAR_GELU_TANH"]


@torch.library.custom_op("vgraph::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")`` with the GELU in the GEMM's epilogue on CUDA."""
    if not x.is_cuda:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh").contiguous()
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


LINEAR_GELU_TANH = torch.ops.vgraph.linear_gelu_tanh
"""The op packet (graphs hold its ``.default`` overload)."""
