"""The rewrite stage (build time): pure FX rewrites of copies of the trace, in order.

Order, and why:
1. ``drop_true_masks`` (both copies): attention masks that are all True by construction are dropped first, so no
   later pass or kernel choice sees them (SDPA then picks its unmasked kernels, as eager does).
2. ``fold_scalars`` (both copies): ``.item()`` of scalar inputs becomes the traced value, before anything is
   compiled or captured (a captured graph cannot read the host).
3. ``select_kernel`` (both copies): each attention site names its kernel.
4. ``sequence_attention`` (both copies): with ``sequence_parallel`` set, full-attention sites attend over the
   process group; after ``select_kernel`` (it replaces a packed kernel there), before ``lower_packed``.
5. ``lower_packed`` (both copies): after the kernel is known, builds packed offsets for the sites whose kernel
   reads them.
6. ``align_matmuls`` (the compiled copy only): pads misaligned matmul widths; last, since it changes parameter
   shapes that only the build binds.
No pass specializes sizes: the compiled graph stays symbolic and every bucket runs it at its own sizes.
"""

from __future__ import annotations

import torch.fx

from vgraph_compile.fx_utils import Pass, apply_pass
from vgraph_compile.rewrite import (
    align_matmuls,
    drop_true_masks,
    fold_scalars,
    lower_packed,
    select_kernel,
    sequence_attention,
)
from vgraph_compile.spec import PassContext

__all__ = ["REWRITES", "COMPILE_REWRITES", "rewrite"]

REWRITES: tuple[tuple[str, Pass], ...] = (
    ("drop_true_masks", drop_true_masks.run),
    ("fold_scalars", fold_scalars.run),
    ("select_kernel", select_kernel.run),
    ("sequence_attention", sequence_attention.run),
    ("lower_packed", lower_packed.run),
)
"""Rewrites of every copy that runs: the eager fallback and the compiled graph."""
COMPILE_REWRITES: tuple[tuple[str, Pass], ...] = (("align_matmuls", align_matmuls.run),)
"""Rewrites of the compiled graph only."""


def rewrite(gm: torch.fx.GraphModule, ctx: PassContext, passes: tuple[tuple[str, Pass], ...]) -> torch.fx.GraphModule:
    """``gm`` after ``passes``, in order (they rewrite it in place: pass a copy to keep the trace)."""
    for name, pass_ in passes:
        gm = apply_pass(name, pass_, gm, ctx)
    return gm
