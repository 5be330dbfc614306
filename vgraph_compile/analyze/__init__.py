"""The analyze stage (trace time): what the traced graph is, as records, without changing it.

Order, and why:
1. ``discover`` (sites, input roles, relations): roles and attention groups come from the traced graph's data
   flow, before any rewrite. It chains ``inputs`` (what the inputs are), ``groups`` (varlen sites and their
   offsets), ``relations`` (sizes the graph ties), ``roles`` (indices and the rest) and ``checks`` (refusals).
2. ``bounds``: per-bucket sizes need the roles; the trace's guards are checked here, before compiling.

Each analysis is ``run(gm, ctx) -> gm`` and fills ``ctx`` (``ctx.spec``, ``ctx.buckets``); none rewrites ``gm``.
"""

from __future__ import annotations

import torch.fx

from vgraph_compile.analyze import bounds, discover
from vgraph_compile.fx_utils import Pass, apply_pass
from vgraph_compile.spec import PassContext

__all__ = ["ANALYSES", "analyze"]

ANALYSES: tuple[tuple[str, Pass], ...] = (
    ("discover", discover.run),
    ("bounds", bounds.run),
)


def analyze(gm: torch.fx.GraphModule, ctx: PassContext) -> PassContext:
    """Run the analyses on the traced graph; fills ``ctx.spec`` and ``ctx.buckets``."""
    for name, pass_ in ANALYSES:
        apply_pass(name, pass_, gm, ctx)
    return ctx
