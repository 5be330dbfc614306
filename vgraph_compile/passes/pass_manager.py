"""The ordered pipeline of passes, and the one wrapper every pass runs through.

Order, and why:
1. ``discover_varlen`` (analysis, once): roles and groups come from the traced graph, before any rewrite.
2. ``bounds`` (analysis, once): per-bucket sizes need the roles; guards are checked here, before compiling.
3. ``pad_varlen`` (rewrite, per bucket, on a copy): needs the bucket's max_seqlen bounds; picks each kernel.
4. ``lower_packed`` (rewrite, per bucket): after the kernel is picked, builds packed offsets for the sites whose
   kernel reads them (it also runs on the eager fallback graph, which needs no bucket).
5. ``specialize`` (rewrite, per bucket, last): removes every input and symbol, so nothing after it can refer
   to the dynamic trace.
The wrapper times each pass, logs the graph before and after at debug level, and lints and recompiles.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Callable

import torch.fx

from vgraph_compile.passes import bounds, discover_varlen, lower_packed, pad_varlen, specialize
from vgraph_compile.passes.spec import BucketShape, PassContext

__all__ = ["ANALYSES", "BUCKET_REWRITES", "analyze", "build_bucket_graph", "apply_pass"]

log = logging.getLogger(__name__)

Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]

ANALYSES: tuple[tuple[str, Pass], ...] = (
    ("discover_varlen", discover_varlen.run),
    ("bounds", bounds.run),
)
BUCKET_REWRITES: tuple[tuple[str, Pass], ...] = (
    ("pad_varlen", pad_varlen.run),
    ("lower_packed", lower_packed.run),
    ("specialize", specialize.run),
)


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


def build_bucket_graph(gm: torch.fx.GraphModule, ctx: PassContext, bucket: BucketShape) -> torch.fx.GraphModule:
    """A static copy of ``gm`` for ``bucket``; ``gm`` itself is left untouched (it stays the eager fallback)."""
    bucket_ctx = dataclasses.replace(ctx, bucket=bucket)
    static = copy.deepcopy(gm)
    for name, pass_ in BUCKET_REWRITES:
        static = apply_pass(name, pass_, static, bucket_ctx)
    return static
