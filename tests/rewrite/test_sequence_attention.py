"""``sequence_attention``: with ``sequence_parallel`` set, full-attention sites attend over the process group, window
sites stay local, and nothing else changes; without it, the graph is untouched."""

import copy
import dataclasses

from expecttest import assert_expected_inline

from tests.helpers import op_count
from vgraph_compile.analyze import analyze
from vgraph_compile.fx_utils import apply_pass
from vgraph_compile.kernels.ops import VARLEN_ATTENTION
from vgraph_compile.rewrite import select_kernel, sequence_attention


def _sites(gm):
    return [node.format_node() for node in gm.graph.nodes if node.target is VARLEN_ATTENTION.default]


def test_full_attention_sites_attend_over_the_group(tiny):
    _, gm, ctx = tiny
    analyze(gm, ctx)
    gm = apply_pass("select_kernel", select_kernel.run, gm, ctx)
    untouched = apply_pass("sequence_attention", sequence_attention.run, copy.deepcopy(gm), ctx)
    assert _sites(untouched) == _sites(gm)
    ctx.config = dataclasses.replace(ctx.config, sequence_parallel=("7", 2))
    rewritten = apply_pass("sequence_attention", sequence_attention.run, copy.deepcopy(gm), ctx)
    assert_expected_inline(
        "\n".join(_sites(rewritten)),
        """%attended : [num_users=1] = call_function[target=torch.ops.vgraph.varlen_attention.default](args = (%q, %k, %v, %l_cu_seqlens_, %l_max_seqlen_), kwargs = {backend: sdpa, sequence_group: 7, sequence_ranks: 2})""",
    )
    assert op_count(rewritten, VARLEN_ATTENTION.default) == 1 and len(rewritten.graph.nodes) == len(gm.graph.nodes)
