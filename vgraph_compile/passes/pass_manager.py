"""The ordered pipeline of passes, and the one wrapper every pass runs through.

Order, and why:
1. ``discover_varlen`` (analysis): roles and groups come from the traced graph, before any rewrite.
2. ``bounds`` (analysis): per-bucket sizes need the roles; the trace's guards are checked here, before compiling.
3. ``fold_scalars`` (rewrite, both copies): ``.item()`` of scalar inputs becomes the traced value, before
   anything is compiled or captured (a captured graph cannot read the host).
4. ``select_kernel`` (rewrite, on the eager copy and the compiled copy): each site names its kernel.
5. ``lower_packed`` (rewrite, both copies): after the kernel is known, builds packed offsets for the sites whose
   kernel reads them.
6. ``align_matmuls`` (rewrite, the compiled copy only): pads misaligned matmul widths; last, since it changes
   parameter shapes that only the build binds.
No pass specializes sizes: the compiled graph stays symbolic and every bucket runs it at its own sizes.
The wrapper times each pass, logs the graph before and after at debug level, and lints and recompiles.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch.fx

from vgraph_compile.passes import align_matmuls, bounds, discover_varlen, fold_scalars, lower_packed, select_kernel
from vgraph_compile.passes.spec import PassContext

__all__ = ["ANALYSES", "REWRITES", "COMPILE_REWRITES", "analyze", "rewrite", "apply_pass"]

log = logging.getLogger(__name__)

Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]

ANALYSES: tuple[tuple[str, Pass], ...] = (
    ("discover_varlen", discover_varlen.run),
    ("bounds", bounds.run),
)
REWRITES: tuple[tuple[str, Pass], ...] = (
    ("fold_scalars", fold_scalars.run),
    ("select_kernel", select_kernel.run),
    ("lower_packed", lower_packed.run),
)
"""Rewrites of every copy that runs: the eager fallback and the compiled graph."""
COMPILE_REWRITES: tuple[tuple[str, Pass], ...] = (("align_matmuls", align_matmuls.run),)
"""Rewrites of the compiled graph only."""


def apply_pass(name: str, pass_: Pass, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Run one pass: timed, graph logged before/after at debug level, then linted and recompiled."""
    debug = log.isEnabledFor(logging.DEBUG)
    if debug:
        log.debug("%s: before\n%s", name, gm.print_readable(print_output=False))
    start = time.perf_counter()
    gm = pass_(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    log.debug("%s took %.1f ms", name, 1e3 * (time.perf_counter() - start))
    if debug:
        log.debug("%s: after\n%s", name, gm.print_readable(print_output=False))
    return gm


def analyze(gm: torch.fx.GraphModule, ctx: PassContext) -> PassContext:
    """Run the analyses on the traced graph; fills ``ctx.spec`` and ``ctx.buckets``."""
    for name, pass_ in ANALYSES:
        apply_pass(name, pass_, gm, ctx)
    return ctx


def rewrite(gm: torch.fx.GraphModule, ctx: PassContext, passes: tuple[tuple[str, Pass], ...]) -> torch.fx.GraphModule:
    """``gm`` after ``passes``, in order (they rewrite it in place: pass a copy to keep the trace)."""
    for name, pass_ in passes:
        gm = apply_pass(name, pass_, gm, ctx)
    return gm
