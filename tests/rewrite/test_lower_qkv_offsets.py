"""``lower_qkv_offsets``: sites whose kernel reads FlashInfer-style Q/K/O|V offsets get them built in the graph from the
padded token cu_seqlens and the real strides; checked on the graph and against eager, in any bucket."""

import copy

import pytest
import torch
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import op_count, trace
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.kernels.ops import PACKED_VARLEN_ATTENTION, VARLEN_ATTENTION
from vgraph_compile.rewrite import lower_qkv_offsets, select_kernel
from vgraph_compile.analyze import analyze
from vgraph_compile.fx_utils import apply_pass


def _lowered_lines(gm):
    keep = ("contiguous", "mul", "cat", "varlen")
    return "\n".join(
        node.format_node() for node in gm.graph.nodes if any(word in f"{node.name} {node.target}" for word in keep)
    )


def test_graph_before_and_after():
    """One token-offset site becomes: q, k contiguous; cu * heads*head_dim; cu * v stride (3x: fused qkv); cat."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    config = VGraphConfig(token_budgets=(64,), max_segments=4, attention_backend="qkv_offsets_reference")
    gm, ctx = trace(model, *pack_images([5, 7], 12), config=config)
    analyze(gm, ctx)
    rewritten = apply_pass("select_kernel", select_kernel.run, copy.deepcopy(gm), ctx)
    assert_expected_inline(
        _lowered_lines(rewritten),
        """%attended : [num_users=1] = call_function[target=torch.ops.vgraph.varlen_attention.default](args = (%q, %k, %v, %l_cu_seqlens_, %l_max_seqlen_), kwargs = {backend: qkv_offsets_reference})""",
    )
    lowered = apply_pass("lower_qkv_offsets", lower_qkv_offsets.run, rewritten, ctx)
    assert_expected_inline(
        _lowered_lines(lowered),
        """\
%contiguous : [num_users=1] = call_method[target=contiguous](args = (%q,), kwargs = {})
%contiguous_1 : [num_users=1] = call_method[target=contiguous](args = (%k,), kwargs = {})
%mul : [num_users=1] = call_function[target=operator.mul](args = (%l_cu_seqlens_, 16), kwargs = {})
%mul_1 : [num_users=1] = call_function[target=operator.mul](args = (%l_cu_seqlens_, 48), kwargs = {})
%cat : [num_users=1] = call_function[target=torch.cat](args = ([%mul, %mul_1],), kwargs = {})
%qkv_offsets_varlen_attention_default : [num_users=1] = call_function[target=torch.ops.vgraph.qkv_offsets_varlen_attention.default](args = (%contiguous, %contiguous_1, %v, %cat, %l_max_seqlen_, None, qkv_offsets_reference), kwargs = {})""",
    )
    assert op_count(lowered, VARLEN_ATTENTION.default) == 0 and op_count(lowered, PACKED_VARLEN_ATTENTION.default) == 1


@pytest.mark.parametrize("backend, lowered", [("sdpa", 0), ("qkv_offsets_reference", 1)])
def test_only_packed_backends_are_lowered(backend, lowered):
    """The same site, with its kernel chosen by select_kernel, is lowered for a packed kernel and left as is
    otherwise."""
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    config = VGraphConfig(token_budgets=(64,), max_segments=4, attention_backend=backend)
    gm, ctx = trace(model, *pack_images([5, 7], 12), config=config)
    analyze(gm, ctx)
    chosen = apply_pass("select_kernel", select_kernel.run, copy.deepcopy(gm), ctx)
    before = chosen.code
    after = apply_pass("lower_qkv_offsets", lower_qkv_offsets.run, chosen, ctx)
    assert op_count(after, PACKED_VARLEN_ATTENTION.default) == lowered
    assert op_count(after, VARLEN_ATTENTION.default) == 1 - lowered
    assert (after.code == before) == (lowered == 0)


@pytest.fixture(scope="module")
def packed():
    """A two-block PackedViT, and its encoder on the Q/K/O|V-offset reference kernel (one bucket of 256 rows),
    traced by a first call."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(
        model, token_budgets=(256,), max_segments=8, compiler="eager", attention_backend="qkv_offsets_reference"
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
    return model, compiled


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_packed_buckets_match_eager(packed, lengths):
    """Every call runs in a bucket much larger than itself (256 rows, 8 segments), served by it (one replay):
    real rows equal eager SDPA."""
    model, compiled = packed
    inputs = pack_images(lengths, 12)
    with torch.no_grad(), counters.expect(replays=1):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)

