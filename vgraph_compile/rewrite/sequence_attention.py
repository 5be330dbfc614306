"""Rewrite: with ``VGraphConfig.sequence_parallel`` set, every full-attention site attends over the process group.

Invariant: only the ``sequence_group`` / ``sequence_ranks`` arguments of ``vgraph::varlen_attention`` sites move,
and only at sites of groups that are not window groups (``analyze.bounds.window_groups``): a rank's slice is cut at
window boundaries, so window segments lie inside one slice and stay local, while full-attention segments may span
slices. A site given a packed kernel (which reads element offsets ``lower_qkv_offsets`` builds from local rows) runs the
``"default"`` kernel instead. Without the config field, nothing changes.

Before/After (``sequence_parallel=("0", 2)``, group 0 full attention, group 1 windows)::

    varlen_attention.default(q, k, v, l_cu_seqlens_, 64, backend='sdpa')
    varlen_attention.default(q_1, k_1, v_1, l_cu_window_seqlens_, 16, backend='sdpa')
    varlen_attention.default(q, k, v, l_cu_seqlens_, 64, backend='sdpa', sequence_group='0', sequence_ranks=2)
    varlen_attention.default(q_1, k_1, v_1, l_cu_window_seqlens_, 16, backend='sdpa')
"""

from __future__ import annotations

import logging

import torch.fx

from vgraph_compile.analyze.bounds import window_groups
from vgraph_compile.analyze.sites import varlen_sites
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import example_value, get_argument, set_argument
from vgraph_compile.kernels import registry
from vgraph_compile.spec import PassContext

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.config.sequence_parallel is None:
        return gm
    group_name, ranks = ctx.config.sequence_parallel
    windows = window_groups(ctx) or set()
    groups = {site.node: site.group for site in ctx.spec.sites}
    spread = 0
    for node, op in varlen_sites(gm):
        if op.name != "vgraph::varlen_attention" or groups.get(node.name) in windows:
            continue
        q = example_value(get_argument(node, op.q))
        if registry.resolve(get_argument(node, op.backend), q.device, q.dtype).qkv_offsets:
            set_argument(node, op.backend, "default")
        set_argument(node, "sequence_group", group_name)
        set_argument(node, "sequence_ranks", ranks)
        spread += 1
    counters.nodes_rewritten += spread
    log.debug("%d varlen sites attend over the %d ranks of process group %s", spread, ranks, group_name)
    return gm
