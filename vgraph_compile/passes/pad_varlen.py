"""Rewrite: each varlen site's symbolic max_seqlen becomes its group's bucket constant, and vgraph's own op gets
the configured kernel.

Invariant: a per-bucket rewrite of a copy; the graph's inputs and outputs are unchanged. A captured kernel reads
max_seqlen on the host at capture, so it must be a bound valid for every call the bucket serves, never a value
computed in the graph (no ``.item()``).

Cases handled:
1. max_seqlen is a symbolic int (an input, or a size expression): replaced by the bucket's bound.
2. max_seqlen is already a Python int in the graph: left alone (dynamo guards it).
3. ``backend="auto"`` (or any name) on ``vgraph::varlen_attention``: replaced by the configured backend resolved
   for the device and dtype of that site's q (``packed_varlen_attention`` sites: only by a packed backend).

Before/After (budget 64)::

    varlen_attention.default(q, k, v, l_cu_, l_max_seqlen_)
    varlen_attention.default(q, k, v, l_cu_, 64, backend='sdpa')
"""

from __future__ import annotations

import logging

import torch.fx

from vgraph_compile import backends
from vgraph_compile.counters import counters
from vgraph_compile.passes.fx_utils import example_value, get_argument, set_argument
from vgraph_compile.passes.sites import varlen_sites
from vgraph_compile.passes.spec import PassContext

__all__ = ["run", "select_backend"]

log = logging.getLogger(__name__)


def select_backend(gm: torch.fx.GraphModule, ctx: PassContext) -> int:
    """Point every vgraph attention site at the configured kernel, resolved for the device and dtype of its own q;
    a site on packed offsets keeps its own kernel unless a packed one is configured. Returns the nodes changed."""
    rewritten = 0
    for node, op in varlen_sites(gm):
        if op.backend is None:
            continue
        q = example_value(get_argument(node, op.q))
        configured = backends.resolve(ctx.config.attention_backend, q.device, q.dtype)
        if op.packed and not configured.packed:
            continue
        configured.prepare(q.device)
        backend = configured.name
        if get_argument(node, op.backend) != backend:
            set_argument(node, op.backend, backend)
            rewritten += 1
    return rewritten


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    bucket = ctx.bucket
    groups = {site.node: site.group for site in ctx.spec.sites}
    rewritten = select_backend(gm, ctx)
    for node, op in varlen_sites(gm):
        for argument in op.max_seqlen:
            if isinstance(get_argument(node, argument), torch.fx.Node):
                set_argument(node, argument, bucket.max_seqlen[groups[node.name]])
                rewritten += 1
    counters.nodes_rewritten += rewritten
    log.debug("budget %d: rewrote %d varlen arguments", bucket.budget, rewritten)
    return gm
