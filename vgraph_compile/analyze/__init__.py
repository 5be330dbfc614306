"""The analyze stage (trace time): what the traced graph is, as records, without changing it.

Order, and why:
1. ``discover`` (sites, input roles, relations): roles and attention groups come from the traced graph's data
   flow, before any rewrite. It chains ``inputs`` (what the inputs are), ``groups`` (varlen sites and their
   offsets), ``relations`` (sizes the graph ties), ``roles`` (indices and the rest) and ``refusals``.
2. ``bounds``: per-bucket sizes need the roles; the trace's guards are checked here, before compiling.

Fixed-tile towers (``pixel_values[N, C, H, W]``, no varlen attention) run ``TILE_ANALYSES`` instead:
``tile_rows`` proves the batch rows independent and describes the tower with N as its token rows, then ``bounds``.

Each analysis is ``run(gm, ctx) -> gm`` and fills ``ctx`` (``ctx.spec``, ``ctx.buckets``); none rewrites ``gm``.
"""

from __future__ import annotations

import torch.fx

from vgraph_compile.analyze import bounds, discover, tile_rows
from vgraph_compile.fx_utils import Pass, apply_pass
from vgraph_compile.spec import PassContext

__all__ = ["ANALYSES", "TILE_ANALYSES", "Analyses", "analyze"]

Analyses = tuple[tuple[str, Pass], ...]

ANALYSES: Analyses = (
    ("discover", discover.run),
    ("bounds", bounds.run),
)
TILE_ANALYSES: Analyses = (
    ("tile_rows", tile_rows.run),
    ("bounds", bounds.run),
)


def analyze(gm: torch.fx.GraphModule, ctx: PassContext, analyses: Analyses = ANALYSES) -> PassContext:
    """Run the analyses on the traced graph; fills ``ctx.spec`` and ``ctx.buckets``."""
    for name, pass_ in analyses:
        apply_pass(name, pass_, gm, ctx)
    return ctx
