"""A tower's FLOPs per forward and the device's measured matmul rate: the MFU's numerator and denominator.

``tower_flops`` is generic: it runs the tower once on the grid (random pixels, vgraph's attention routing) under
torch's ``FlopCounterMode`` and counts what ran, whatever the family: every matmul, linear and convolution by the
shapes of its operands (torch's own formulas; composite ops such as ``aten.linear``, which reach the counter
undecomposed under ``torch.inference_mode``, are decomposed by it), and every ``vgraph::varlen_attention`` call as
``4 * sum(segment length^2) * heads * head_dim`` from its segment offsets (QK^T and PV; a window layer counts its
windows). Nothing is read from a family's config.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from vgraph_compile.bench.timing import median_ms
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.packed_tower import PackedTower, learn_packed_tower

__all__ = ["matmul_peak_tflops", "tower_flops", "varlen_attention_flops"]


def matmul_peak_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10), the MFU denominator."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b, repeats=10) / 1e9


def varlen_attention_flops(q: torch.Tensor, k, v, cu_seqlens: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """``vgraph::varlen_attention``'s FLOPs (``q``: ``[tokens, heads, head_dim]``): QK^T and PV over each segment
    of ``cu_seqlens``, ``4 * sum(length^2) * heads * head_dim``; in ``FlopCounterMode``'s formula signature."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return 4 * int((lengths * lengths).sum()) * q.shape[1] * q.shape[2]


varlen_attention_flops._get_raw = True  # FlopCounterMode passes the tensors (the offsets' values), not shapes


def tower_flops(tower: torch.nn.Module, grid, interface: PackedTower | None = None) -> int:
    """FLOPs of one forward of ``tower`` on ``grid`` ((t, h, w) rows in patches), counted as the module docstring
    says (the patch embedding and merger included); ``interface``: the tower's, when already learned."""
    interface = interface or learn_packed_tower(tower)
    parameter = next(tower.parameters())
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixel_values = torch.randn(interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
    pixel_values = pixel_values.to(parameter.device, parameter.dtype)
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.vgraph.varlen_attention: varlen_attention_flops})
    with torch.no_grad(), routed_attention(tower), counter:
        tower(pixel_values, **{interface.grid_argument: grid_thw.to(parameter.device)})
    return counter.get_total_flops()
