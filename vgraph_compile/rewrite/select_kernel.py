"""Rewrite: every ``vgraph::varlen_attention`` site names the kernel that runs it.

Invariant: inputs, outputs and every other node are unchanged; only the ``backend`` argument of vgraph's own ops
moves. It runs on the eager fallback and on the graph inductor compiles alike, so both run the same kernel. A
site takes its attention group's measured kernels (``ctx.kernels``, from the build's timing: one name, or one per
bucket as ``registry.by_rows`` writes them) when there are some,
else the configured kernel resolved for the device and dtype of its own q; a site on Q/K/O|V offsets keeps its
kernel unless a packed one is configured. Nothing is timed or allocated here: the build does that
(``rewrite/kernel_choice``, ``kernels_used``).

Before/After (``attention_backend="sdpa"``)::

    varlen_attention.default(q, k, v, l_cu_seqlens_, l_max_seqlen_)
    varlen_attention.default(q, k, v, l_cu_seqlens_, l_max_seqlen_, backend='sdpa')
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.fx

from vgraph_compile.kernels import registry
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value, get_argument, set_argument
from vgraph_compile.analyze.sites import Site, varlen_sites
from vgraph_compile.spec import PassContext

__all__ = ["run", "kernels_used", "kernels_by_group"]

log = logging.getLogger(__name__)


def _kernel_sites(gm: torch.fx.GraphModule) -> Iterator[Site]:
    """Sites of ops that take a ``backend`` argument."""
    return (site for site in varlen_sites(gm) if site.op.backend is not None)


def kernels_used(gm: torch.fx.GraphModule) -> set[tuple[str, torch.device]]:
    """(kernel name, device) of every kernel a site may run, for the build to prepare before any graph is
    captured."""
    return {
        (kernel, example_value(node).device)
        for node, op in _kernel_sites(gm)
        for kernel in registry.kernel_names(get_argument(node, op.backend))
    }


def kernels_by_group(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[int, str]:
    """Attention group -> the kernel its sites run (for the stats table and ``vgraph explain``)."""
    groups = {site.node: site.group for site in ctx.spec.sites}
    return {groups[node.name]: get_argument(node, op.backend) for node, op in _kernel_sites(gm) if node.name in groups}


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    groups = {site.node: site.group for site in ctx.spec.sites}
    rewritten = 0
    for node, op in _kernel_sites(gm):
        q = example_value(get_argument(node, op.q))
        name = ctx.kernels.get(groups.get(node.name), ctx.config.attention_backend)
        if name == "auto":  # nothing was timed for this group: the ops' fixed rule
            name = "default"
        kernels = [registry.resolve(kernel, q.device, q.dtype) for kernel in registry.kernel_names(name)]
        if op.qkv_offsets and not all(kernel.qkv_offsets for kernel in kernels):
            continue
        chosen = name if len(kernels) > 1 else kernels[0].name
        if get_argument(node, op.backend) != chosen:
            set_argument(node, op.backend, chosen)
            rewritten += 1
    counters.nodes_rewritten += rewritten
    log.debug("pointed %d varlen sites at the configured kernel", rewritten)
    return gm
