"""Rewrite: sites whose kernel reads packed element offsets (FlashInfer's cuDNN prefill) get them built in the graph.

Invariant: applies only to sites of ops that lower to Q/K/O|V offsets (``VarlenOp.lowers_to_qkv_offsets``:
``vgraph::varlen_attention``) whose ``backend`` is a packed backend (others are left alone). The packed buffer is
computed from the site's token ``cu_seqlens`` inside the graph, with the real token strides: ``[cu * heads * head_dim | cu * v.stride(0)]``. Since the runtime pads ``cu_seqlens`` by repeating
its last offset, each half is padded by its own last value by construction; no packed buffer is ever padded as one
flat sequence. q and k are made contiguous so that one Q/K/O half describes all three.

Before/After::

    varlen_attention.default(q, k, v, cu, 64, backend='flashinfer')

    contiguous = q.contiguous();  contiguous_1 = k.contiguous()
    mul = cu * 32;  mul_1 = cu * 96;  cat = torch.cat([mul, mul_1])
    qkv_offsets_varlen_attention.default(contiguous, contiguous_1, v, cat, 64, None, 'flashinfer')
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from vgraph_compile.kernels import registry
from vgraph_compile.counters import counters
from vgraph_compile.kernels.ops import PACKED_VARLEN_ATTENTION
from vgraph_compile.fx_utils import example_value
from vgraph_compile.analyze.sites import Site, varlen_sites
from vgraph_compile.spec import PassContext

__all__ = ["run"]

log = logging.getLogger(__name__)


def _packed_backend(site: Site) -> str | None:
    if not site.op.lowers_to_qkv_offsets:
        return None
    name = site.argument(site.op.backend)
    return name if name in registry.BACKENDS and registry.BACKENDS[name].qkv_offsets else None


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    lowered = 0
    for site in list(varlen_sites(gm)):
        backend = _packed_backend(site)
        if backend is None:
            continue
        node = site.node
        q, k, v, cu = (site.argument(name) for name in ("q", "k", "v", "cu_seqlens"))
        fake_q, fake_v = example_value(q), example_value(v)
        row, v_row = fake_q.shape[1] * fake_q.shape[2], fake_v.stride(0)
        if not isinstance(row, int) or not isinstance(v_row, int):
            raise ValueError(
                f"{node.format_node()}: Q/K/O|V offsets need static head and row widths (got {row}, {v_row})"
            )
        with graph.inserting_before(node):
            q_rows = graph.call_method("contiguous", (q,))
            k_rows = graph.call_method("contiguous", (k,))
            qko = graph.call_function(operator.mul, (cu, row))
            v_offsets = graph.call_function(operator.mul, (cu, v_row))
            packed = graph.call_function(torch.cat, ([qko, v_offsets],))
            lowered_node = graph.call_function(
                PACKED_VARLEN_ATTENTION.default,
                (q_rows, k_rows, v, packed, site.argument("max_seqlen"), site.argument("scale"), backend),
            )
        lowered_node.meta.update(node.meta)
        node.replace_all_uses_with(lowered_node)
        graph.erase_node(node)
        lowered += 1
    counters.nodes_rewritten += lowered
    if lowered:
        log.debug("lowered %d varlen sites to Q/K/O|V offsets", lowered)
    return gm
