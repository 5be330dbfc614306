"""The rewrite stage (build time): the kernel choice, then pure FX rewrites of two copies of the trace, in order.

``rewrite_trace(gm, ctx)`` is the stage: it reads the scalars to fold (``fold_scalars.folded``), chooses each
attention group's kernel (``kernel_choice``: timed at the buckets' shapes on a GPU for ``attention_backend="auto"``;
first, since ``select_kernel`` writes the choice into both copies), then rewrites a copy for the eager fallback
(``REWRITES``) and a copy to compile (``REWRITES + COMPILE_REWRITES``). The trace itself is left as traced.

Order of the passes, and why:
0. ``patch_matmuls`` (both copies): a patch-embedding convolution becomes a matmul over its patches; it touches no
   attention, so its place only needs to precede ``align_matmuls``, which may then see its linear.
1. ``drop_true_masks`` (both copies): attention masks that are all True by construction are dropped first, so no
   later pass or kernel choice sees them (SDPA then picks its unmasked kernels, as eager does).
2. ``fold_scalars`` (both copies): ``.item()`` of scalar inputs becomes the traced value, before anything is
   compiled or captured (a captured graph cannot read the host).
3. ``select_kernel`` (both copies): each attention site names its kernel.
4. ``sequence_attention`` (both copies): with ``sequence_parallel`` set, full-attention sites attend over the
   process group; after ``select_kernel`` (it replaces a packed kernel there), before ``lower_qkv_offsets``.
5. ``lower_qkv_offsets`` (both copies): after the kernel is known, builds Q/K/O|V offsets for the sites whose kernel
   reads them.
6. ``align_matmuls`` (the compiled copy only): pads misaligned matmul widths; it changes parameter shapes that only
   the build binds.
7. ``gelu_epilogues`` (the compiled copy only, on CUDA): a linear and its tanh GELU become one GEMM with the GELU
   in its epilogue; after ``align_matmuls``, which must see the linear to pad its width.
No pass specializes sizes: the compiled graph stays symbolic and every bucket runs it at its own sizes.
"""

from __future__ import annotations

import torch.fx

import copy
from dataclasses import dataclass

from vgraph_compile.counters import startup_phases
from vgraph_compile.fx_utils import Pass, apply_pass
from vgraph_compile.rewrite import (
    align_matmuls,
    drop_true_masks,
    fold_scalars,
    gelu_epilogues,
    kernel_choice,
    lower_qkv_offsets,
    patch_matmuls,
    select_kernel,
    sequence_attention,
)
from vgraph_compile.spec import PassContext

__all__ = ["REWRITES", "COMPILE_REWRITES", "Rewritten", "rewrite", "rewrite_trace"]

REWRITES: tuple[tuple[str, Pass], ...] = (
    ("patch_matmuls", patch_matmuls.run),
    ("drop_true_masks", drop_true_masks.run),
    ("fold_scalars", fold_scalars.run),
    ("select_kernel", select_kernel.run),
    ("sequence_attention", sequence_attention.run),
    ("lower_qkv_offsets", lower_qkv_offsets.run),
)
"""Rewrites of every copy that runs: the eager fallback and the compiled graph."""
COMPILE_REWRITES: tuple[tuple[str, Pass], ...] = (
    ("align_matmuls", align_matmuls.run),
    ("gelu_epilogues", gelu_epilogues.run),
)
"""Rewrites of the compiled graph only."""


def rewrite(gm: torch.fx.GraphModule, ctx: PassContext, passes: tuple[tuple[str, Pass], ...]) -> torch.fx.GraphModule:
    """``gm`` after ``passes``, in order (they rewrite it in place: pass a copy to keep the trace)."""
    for name, pass_ in passes:
        gm = apply_pass(name, pass_, gm, ctx)
    return gm


@dataclass(frozen=True)
class Rewritten:
    """The rewrite stage's result for one trace."""

    eager: torch.fx.GraphModule
    """The trace after ``REWRITES``: run as is for calls no bucket serves."""
    compiled: torch.fx.GraphModule
    """The trace after ``REWRITES + COMPILE_REWRITES``: the graph inductor compiles once."""
    kernels: dict[int, str]
    """Attention group -> the kernel its sites run."""
    folded: dict[int, float | int | bool]
    """Graph input index -> the scalar value the graphs are built with (``fold_scalars``)."""
    prepared: tuple[tuple[str, str], ...]
    """(kernel, device) of each kernel the compiled graph calls, whose state assembly prepares."""


def rewrite_trace(gm: torch.fx.GraphModule, ctx: PassContext) -> Rewritten:
    """The kernel choice and both rewritten copies of ``gm`` (module docstring); ``gm`` is left as traced."""
    folded = fold_scalars.folded(gm, ctx)
    with startup_phases.phase("kernel_timing"):
        ctx.kernels = kernel_choice.choose_kernels(gm, ctx)
    eager = rewrite(copy.deepcopy(gm), ctx, REWRITES)
    compiled = rewrite(copy.deepcopy(gm), ctx, REWRITES + COMPILE_REWRITES)
    prepared = tuple((name, str(device)) for name, device in select_kernel.kernels_used(compiled))
    return Rewritten(eager, compiled, select_kernel.kernels_by_group(compiled, ctx), folded, prepared)
