"""Rewrite: a patch-embedding convolution, whose stride equals its kernel, becomes one matmul over the patches.

ViTs embed patches with ``conv2d``/``conv3d(x, W, b, stride=kernel)``. cuDNN runs such a convolution with a generic
implicit-GEMM kernel: on an H200 it took 0.7-1.7 ms per call of a Qwen-VL or GLM-4.1V tower (``conv3d`` over
``[rows, 3, 2, 14, 14]``: about 0.05 ms of work at the linear layers' rate) and 0.76 ms of InternViT at 13 tiles
(``benchmarks/results/roofline_h200_cuda_2026-11-28_first.json``, the profiles' top kernels). As a matmul it runs
in cuBLAS like every other linear layer.

Invariant: exact up to the order of the sums. Each output position of such a convolution is the dot product of one
patch (its ``C x kernel`` entries, in ``C, k1, k2, ...`` order, as the filters are laid out) with every filter,
plus the bias: one row of ``patches @ W.reshape(out, -1).T + b``. The result has the convolution's shape and is
contiguous, as the convolution's is.

Cases handled (legality, ``patch_convolution``): ``conv1d``/``conv2d``/``conv3d`` calls (positional or keyword
arguments) with stride equal to the kernel size, no padding (zeros or ``"valid"``), dilation 1, one group, a
batched input whose spatial dims are static multiples of the kernel's:
- spatial dims equal to the kernel (a packed tower's rows, one patch each): ``x.reshape(-1, C * k)``, the linear,
  then the output reshaped to ``[N, out, 1, ...]``;
- a grid of patches (tiles): ``x`` reshaped to ``[N, C, h1, k1, h2, k2, ...]``, the kernel dims moved next to
  ``C``, the linear over them, the output channels moved back in front of the grid.

Before/After (Qwen2-VL's patch embedding, 32 channels)::

    conv3d = conv3d(x, w, None, (2, 14, 14), (0, 0, 0), (1, 1, 1), 1)
                                                       patches = x.reshape(-1, 1176)
                                                       filters = w.reshape(32, -1)
                                                       linear = linear(patches, filters, None)
                                                       conv3d = linear.reshape(-1, 32, 1, 1, 1)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import PassContext

__all__ = ["run", "patch_convolution", "PatchConvolution"]

log = logging.getLogger(__name__)

_CONVOLUTIONS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
"""Convolution callables by their number of spatial dims."""
_PARAMETERS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


@dataclass(frozen=True)
class PatchConvolution:
    """A convolution that is a matmul over patches: its nodes, and the static sizes the rewrite needs."""

    input: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    channels: int
    out_channels: int
    kernel: tuple[int, ...]
    grid: tuple[int, ...]
    """Patches along each spatial dim (all 1: one patch per input row)."""


def _arguments(node: torch.fx.Node) -> dict:
    values = dict(zip(_PARAMETERS, node.args))
    values.update(node.kwargs)
    return values


def _tuple(value, dims: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def patch_convolution(node: torch.fx.Node) -> PatchConvolution | None:
    """The patch convolution ``node`` is (legality: module docstring), or None."""
    if node.op != "call_function" or node.target not in _CONVOLUTIONS:
        return None
    dims = _CONVOLUTIONS[node.target]
    arguments = _arguments(node)
    x, weight = arguments.get("input"), arguments.get("weight")
    if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return None
    x_value, weight_value = example_value(x), example_value(weight)
    if not isinstance(x_value, torch.Tensor) or not isinstance(weight_value, torch.Tensor):
        return None
    if x_value.dim() != dims + 2 or weight_value.dim() != dims + 2:
        return None
    kernel = tuple(weight_value.shape[2:])
    padding = arguments.get("padding", 0)
    if not all(isinstance(size, int) for size in (*kernel, *x_value.shape[1:], weight_value.shape[0])):
        return None
    stride = _tuple(arguments.get("stride", 1), dims)
    dilation = _tuple(arguments.get("dilation", 1), dims)
    if (
        stride != kernel
        or not (padding == "valid" or all(p == 0 for p in _tuple(padding, dims)))
        or any(d != 1 for d in dilation)
        or arguments.get("groups", 1) != 1
        or weight_value.shape[1] != x_value.shape[1]
        or any(size % k for size, k in zip(x_value.shape[2:], kernel))
    ):
        return None
    bias = arguments.get("bias")
    return PatchConvolution(
        x,
        weight,
        bias if isinstance(bias, torch.fx.Node) else None,
        int(x_value.shape[1]),
        int(weight_value.shape[0]),
        kernel,
        tuple(size // k for size, k in zip(x_value.shape[2:], kernel)),
    )


def _insert(graph: torch.fx.Graph, op: str, target, args: tuple) -> torch.fx.Node:
    """A new node, its example value computed from its inputs' under their fake mode."""
    node = graph.create_node(op, target, args)
    values = [example_value(arg) if isinstance(arg, torch.fx.Node) else arg for arg in args]
    mode = next(value.fake_mode for value in values if isinstance(value, torch.Tensor))
    with mode:
        node.meta["example_value"] = (
            getattr(values[0], target)(*values[1:]) if op == "call_method" else target(*values)
        )
    return node


def _as_matmul(graph: torch.fx.Graph, conv: PatchConvolution) -> torch.fx.Node:
    """The nodes computing the convolution as a matmul over patches; returns the last."""
    dims, patch = len(conv.kernel), conv.channels * math.prod(conv.kernel)
    x = conv.input
    one_patch = all(count == 1 for count in conv.grid)
    if not one_patch:
        split = [size for count, k in zip(conv.grid, conv.kernel) for size in (count, k)]
        x = _insert(graph, "call_method", "reshape", (x, [-1, conv.channels, *split]))
        order = [0, *range(2, 2 + 2 * dims, 2), 1, *range(3, 3 + 2 * dims, 2)]
        x = _insert(graph, "call_method", "permute", (x, order))
    patches = _insert(graph, "call_method", "reshape", (x, [-1, patch]))
    filters = _insert(graph, "call_method", "reshape", (conv.weight, [conv.out_channels, patch]))
    out = _insert(graph, "call_function", F.linear, (patches, filters, conv.bias))
    if one_patch:
        return _insert(graph, "call_method", "reshape", (out, [-1, conv.out_channels, *conv.grid]))
    out = _insert(graph, "call_method", "reshape", (out, [-1, *conv.grid, conv.out_channels]))
    out = _insert(graph, "call_method", "permute", (out, [0, dims + 1, *range(1, dims + 1)]))
    return _insert(graph, "call_method", "contiguous", (out,))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    rewritten = 0
    for node in list(gm.graph.nodes):
        conv = patch_convolution(node)
        if conv is None:
            continue
        with gm.graph.inserting_before(node):
            replacement = _as_matmul(gm.graph, conv)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        rewritten += 1
    counters.nodes_rewritten += rewritten
    if rewritten:
        log.debug("ran %d patch convolutions as matmuls over their patches", rewritten)
    return gm
