"""A tower's FLOPs per forward, split into attention and the rest, the roofline time they bound, and the device's
measured matmul rate.

``count_flops`` runs a call under torch's ``FlopCounterMode`` and counts what ran, whatever the family: every
matmul, linear and convolution by the shapes of its operands (torch's own formulas; composite ops such as
``aten.linear``, which reach the counter undecomposed under ``torch.inference_mode``, are decomposed by it), every
``vgraph::varlen_attention`` call as ``4 * sum(segment length^2) * heads * head_dim`` from its segment offsets (QK^T
and PV; a window layer counts its windows), and every SDPA kernel call as ``4 * batch * heads * rows_q * rows_k *
head_dim`` (torch's formula, and the same for the CPU's flash kernel, which torch does not count). The attention
share is what those attention ops counted; everything else counted (linear layers, convolutions, the few small
matmuls a tower runs outside its attention kernels, such as ``nn.MultiheadAttention``'s one-query pooling) is the
linear share. ``tower_flop_split`` does it for a packed tower on a grid, with vgraph's attention routing, so every
attention segment is counted as one; nothing is read from a family's config.

The roofline (``FlopSplit.roofline_ms``): attention FLOPs at ``ATTENTION_TFLOPS`` plus the linear FLOPs at
``LINEAR_TFLOPS``, everything else (norms, activations, copies) counted as free: the time an H100/H200 would take
in bf16 with every kernel at the rate the best installable kernels reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from vgraph_compile.bench.timing import median_ms
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.packed_tower import PackedTower, learn_packed_tower

__all__ = [
    "ATTENTION_TFLOPS",
    "LINEAR_TFLOPS",
    "FlopSplit",
    "count_flops",
    "matmul_peak_tflops",
    "tower_flop_split",
    "tower_flops",
    "varlen_attention_flops",
]

ATTENTION_TFLOPS = 500.0
"""The roofline's attention rate, bf16 TFLOP/s (H100/H200: FlashAttention-4 measured 506 at head_dim 72 on an H200)."""
LINEAR_TFLOPS = 650.0
"""The roofline's rate for every other counted FLOP (linear layers, convolutions), bf16 TFLOP/s (H100/H200)."""


@dataclass(frozen=True)
class FlopSplit:
    """FLOPs of one call: in attention kernels, and in the rest that was counted (linear layers, convolutions)."""

    attention: int
    linear: int

    @property
    def total(self) -> int:
        return self.attention + self.linear

    @property
    def roofline_ms(self) -> float:
        """Attention FLOPs at ``ATTENTION_TFLOPS`` plus the linear FLOPs at ``LINEAR_TFLOPS``, in ms."""
        return self.attention / (ATTENTION_TFLOPS * 1e9) + self.linear / (LINEAR_TFLOPS * 1e9)

    def __add__(self, other: FlopSplit) -> FlopSplit:
        return FlopSplit(self.attention + other.attention, self.linear + other.linear)


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


def _cpu_sdpa_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """The CPU flash SDPA kernel's FLOPs (``[batch, heads, rows, head_dim]``): QK^T and PV, as torch counts its CUDA
    SDPA kernels."""
    batch, heads, rows_q, head_dim = query.shape
    rows_k, value_dim = key.shape[-2], value.shape[-1]
    return 2 * batch * heads * rows_q * rows_k * (head_dim + value_dim)


_cpu_sdpa_flops._get_raw = True


def _attention_ops() -> tuple[Any, ...]:
    """The op packets whose FLOPs are attention: vgraph's varlen op and SDPA's kernels (CUDA, CPU, flex)."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    ops = [getattr(aten, name) for name in names if hasattr(aten, name)]
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return (torch.ops.vgraph.varlen_attention, *ops, *([flex] if flex is not None else []))


def count_flops(fn: Callable[[], Any]) -> FlopSplit:
    """The FLOPs of ``fn()``, split into attention and the rest (module docstring), under ``torch.no_grad``."""
    mapping = {torch.ops.vgraph.varlen_attention: varlen_attention_flops}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with torch.no_grad(), counter:
        fn()
    attention_ops = _attention_ops()
    by_op = counter.get_flop_counts().get("Global", {})
    attention = sum(int(flops) for op, flops in by_op.items() if op in attention_ops)
    return FlopSplit(attention, int(counter.get_total_flops()) - attention)


def tower_flop_split(tower: torch.nn.Module, grid, interface: PackedTower | None = None) -> FlopSplit:
    """FLOPs of one forward of ``tower`` on ``grid`` ((t, h, w) rows in patches; random pixels), its attention
    routed through ``vgraph::varlen_attention`` so each segment counts as one, split as the module docstring says
    (the patch embedding and merger included); ``interface``: the tower's, when already learned."""
    interface = interface or learn_packed_tower(tower)
    parameter = next(tower.parameters())
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixel_values = torch.randn(interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
    pixel_values = pixel_values.to(parameter.device, parameter.dtype)
    arguments = {interface.grid_argument: grid_thw.to(parameter.device)}
    with routed_attention(tower):
        return count_flops(lambda: tower(pixel_values, **arguments))


def tower_flops(tower: torch.nn.Module, grid, interface: PackedTower | None = None) -> int:
    """FLOPs of one forward of ``tower`` on ``grid``, attention and the rest together (``tower_flop_split``)."""
    return tower_flop_split(tower, grid, interface).total
