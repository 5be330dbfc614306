"""``select_kernel``: every vgraph attention site names the configured kernel, and nothing else changes."""

import copy

import torch
from expecttest import assert_expected_inline

from tests.helpers import op_count
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.ops import VARLEN_ATTENTION
from vgraph_compile.rewrite import select_kernel
from vgraph_compile.analyze import analyze
from vgraph_compile.fx_utils import apply_pass


def _site(gm):
    return next(node for node in gm.graph.nodes if node.target is VARLEN_ATTENTION.default)


def test_site_names_the_configured_kernel(tiny):
    """The kernel argument is set; max_seqlen stays the traced input (each bucket passes its own value)."""
    _, gm, ctx = tiny
    analyze(gm, ctx)
    assert_expected_inline(
        str(_site(gm).format_node()),
        """%attended : [num_users=1] = call_function[target=torch.ops.vgraph.varlen_attention.default](args = (%q, %k, %v, %l_cu_seqlens_, %l_max_seqlen_), kwargs = {})""",
    )
    rewritten = apply_pass("select_kernel", select_kernel.run, copy.deepcopy(gm), ctx)
    assert_expected_inline(
        str(_site(rewritten).format_node()),
        """%attended : [num_users=1] = call_function[target=torch.ops.vgraph.varlen_attention.default](args = (%q, %k, %v, %l_cu_seqlens_, %l_max_seqlen_), kwargs = {backend: sdpa})""",
    )
    assert op_count(rewritten, VARLEN_ATTENTION.default) == op_count(gm, VARLEN_ATTENTION.default) == 1
    assert len(rewritten.graph.nodes) == len(gm.graph.nodes)
    assert select_kernel.kernels_used(rewritten) == {("sdpa", torch.device("cpu"))}


def test_a_per_bucket_choice_is_one_argument_and_each_kernel_is_prepared(tiny):
    """A group timed to different kernels per bucket (``registry.by_rows``) names them all in its one site, the
    build prepares each, and the stats name the choice (the op's pick by rows: ``tests/kernels/test_dense.py``)."""
    _, gm, ctx = tiny
    analyze(gm, ctx)
    ctx.kernels = {0: registry.by_rows({16: "dense_flash", 64: "sdpa"})}
    rewritten = apply_pass("select_kernel", select_kernel.run, copy.deepcopy(gm), ctx)
    assert _site(rewritten).kwargs == {"backend": "16:dense_flash;64:sdpa"}
    assert select_kernel.kernels_used(rewritten) == {("dense_flash", torch.device("cpu")), ("sdpa", torch.device("cpu"))}
    assert select_kernel.kernels_by_group(rewritten, ctx) == {0: "16:dense_flash;64:sdpa"}
