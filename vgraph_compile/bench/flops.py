"""A tower's FLOPs per forward and the device's measured matmul rate: the MFU's numerator and denominator.

``tower_flops`` is generic: it runs the tower once on the grid (random pixels, vgraph's attention routing) and
counts what ran, whatever the family: every matmul, linear and convolution by the shapes of its operands (torch's
own FLOP formulas, ``torch.utils.flop_counter``), and every ``vgraph::varlen_attention`` call as
``4 * sum(segment length^2) * heads * head_dim`` from its segment offsets (QK^T and PV). Nothing is read from a
family's config.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from vgraph_compile.bench.timing import median_ms
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.packed_tower import PackedTower, learn_packed_tower

__all__ = ["matmul_peak_tflops", "tower_flops"]


def matmul_peak_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10), the MFU denominator."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b, repeats=10) / 1e9


def _attention_flops(q: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return 4 * int((lengths * lengths).sum()) * q.shape[1] * q.shape[2]


class _FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the ops it sees: torch's formulas, and segment attention from its offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet is torch.ops.vgraph.varlen_attention:
            self.flops += _attention_flops(args[0], args[3])
        elif packet in flop_registry:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        return out


def tower_flops(tower: torch.nn.Module, grid, interface: PackedTower | None = None) -> int:
    """FLOPs of one forward of ``tower`` on ``grid`` ((t, h, w) rows in patches), counted as the module docstring
    says (the patch embedding and merger included); ``interface``: the tower's, when already learned."""
    interface = interface or learn_packed_tower(tower)
    parameter = next(tower.parameters())
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixel_values = torch.randn(interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
    pixel_values = pixel_values.to(parameter.device, parameter.dtype)
    counter = _FlopCount()
    with torch.no_grad(), routed_attention(tower), counter:
        tower(pixel_values, **{interface.grid_argument: grid_thw.to(parameter.device)})
    return counter.flops
