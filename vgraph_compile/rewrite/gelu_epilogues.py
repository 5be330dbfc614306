"""Rewrite: a linear followed by the tanh GELU becomes ``vgraph::linear_gelu_tanh``, the GELU in the GEMM's epilogue.

Inductor runs a linear as an extern cuBLAS GEMM and the GELU after it as a Triton kernel of its own: one more write
and read of the ``[rows, intermediate]`` activation per layer. ``kernels/gemm_epilogues`` states the op and what
it costs; this pass puts it where the graph has the pattern.

Cases handled (legality, ``linear_gelu``): ``gelu(linear(x, W, b), approximate="tanh")`` (``F.gelu`` or
``torch._C._nn.gelu``, the approximation positional or keyword) where the linear has a bias, a 2-D weight and no
other user, in fp16 or bf16. The exact GELU (``approximate="none"``), quick GELU and gated MLPs are left to
inductor: cuBLASLt's epilogue is the tanh GELU only. float32 is left too: on an H200 the float32 test against the
unfused layer failed at 1 and 7 rows (the cause not yet read), where the bf16 one passed.
Profitability: on CUDA, where the epilogue exists (the op's CPU path is the unfused layer, correct but no faster).
It runs on the compiled copy after ``align_matmuls``, whose padded widths it keeps (the GELU of a padded column is
``gelu(0) = 0``, as before).

Before/After (Qwen3-VL's MLP)::

    linear_fc1 = linear(x, w1, b1)
    gelu = gelu(linear_fc1, approximate = 'tanh')      gelu = vgraph.linear_gelu_tanh(x, w1, b1)
    linear_fc2 = linear(gelu, w2, b2)                  linear_fc2 = linear(gelu, w2, b2)
"""

from __future__ import annotations

import logging

import torch
import torch.fx
import torch.nn.functional as F

from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value
from vgraph_compile.kernels.gemm_epilogues import LINEAR_GELU_TANH
from vgraph_compile.spec import PassContext

__all__ = ["run", "linear_gelu"]

log = logging.getLogger(__name__)

_LINEAR = {torch._C._nn.linear, F.linear}
_GELU = {torch._C._nn.gelu, F.gelu}
_HALF = (torch.float16, torch.bfloat16)


def _tanh_gelu(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _GELU:
        return False
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return approximate == "tanh"


def linear_gelu(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """``(x, weight, bias)`` of the linear whose tanh GELU ``node`` is (legality: module docstring), or None."""
    if not _tanh_gelu(node) or not isinstance(node.args[0], torch.fx.Node):
        return None
    linear = node.args[0]
    if linear.op != "call_function" or linear.target not in _LINEAR or len(linear.users) != 1:
        return None
    arguments = dict(zip(("input", "weight", "bias"), linear.args))
    arguments.update(linear.kwargs)
    x, weight, bias = arguments.get("input"), arguments.get("weight"), arguments.get("bias")
    if not all(isinstance(value, torch.fx.Node) for value in (x, weight, bias)):
        return None
    weight_value = example_value(weight)
    if not isinstance(weight_value, torch.Tensor) or weight_value.dim() != 2 or weight_value.dtype not in _HALF:
        return None
    return x, weight, bias


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.device.type != "cuda":
        return gm
    fused = 0
    for node in list(gm.graph.nodes):
        matched = linear_gelu(node)
        if matched is None:
            continue
        linear = node.args[0]
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(LINEAR_GELU_TANH.default, matched)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        gm.graph.erase_node(linear)
        fused += 1
    counters.nodes_rewritten += fused
    if fused:
        log.debug("ran %d tanh GELUs in their linear's GEMM epilogue", fused)
    return gm
