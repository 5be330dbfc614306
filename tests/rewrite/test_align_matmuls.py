"""``align_matmuls``: misaligned MLP widths padded with zeros; the graph before/after, and exact results."""

import copy

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import trace
import vgraph_compile
from vgraph_compile.config import VGraphConfig
from vgraph_compile.sample_models.packed_vit import pack_images
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.rewrite import align_matmuls
from vgraph_compile.analyze import analyze
from vgraph_compile.fx_utils import apply_pass
from vgraph_compile.rewrite.align_matmuls import PADDED_SHAPE
from vgraph_compile.spec import user_name


class GatedBlock(torch.nn.Module):
    """Attention, then Qwen2.5-VL's gated MLP (``down(silu(gate(x)) * up(x))``) with an inner width of 60."""

    def __init__(self, width: int = 16, inner: int = 60) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.gate = torch.nn.Linear(width, inner)
        self.up = torch.nn.Linear(width, inner)
        self.down = torch.nn.Linear(inner, width)

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, -1).unbind(1)
        x = x + varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(x.shape[0], -1)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def _mlp_lines(gm, spec):
    """The MLP's nodes (after the attention output is added back) with their shapes in the user's names."""
    nodes = list(gm.graph.nodes)
    start = next(i for i, node in enumerate(nodes) if node.name == "x")
    lines = []
    for node in nodes[start + 1 :]:
        value = node.meta.get("example_value")
        if node.op == "call_function" and isinstance(value, torch.Tensor):
            dims = [spec.describe(size.node.expr) if isinstance(size, torch.SymInt) else size for size in value.shape]
            lines.append(f"{node.name} = {getattr(node.target, '__name__', node.target)}: {dims}")
    return "\n".join(lines)


@pytest.fixture
def traced():
    torch.manual_seed(0)
    model = GatedBlock().eval()
    inputs = pack_images([5, 7], 16)
    config = VGraphConfig(token_budgets=(16, 64), max_segments=4, attention_backend="sdpa", align_matmuls=True)
    gm, ctx = trace(model, *inputs, config=config)
    analyze(gm, ctx)
    return model, inputs, gm, ctx


def test_gated_mlp_before_and_after(traced):
    """gate and up grow 60 -> 64 rows, down 60 -> 64 columns; the region between them widens; nothing else."""
    _, _, gm, ctx = traced
    before = _mlp_lines(gm, ctx.spec)
    assert_expected_inline(
        before,
        """\
linear_1 = linear: ['x.shape[0]', 60]
silu = silu: ['x.shape[0]', 60]
linear_2 = linear: ['x.shape[0]', 60]
mul = mul: ['x.shape[0]', 60]
linear_3 = linear: ['x.shape[0]', 16]
add_1 = add: ['x.shape[0]', 16]""",
    )
    aligned = apply_pass("align_matmuls", align_matmuls.run, copy.deepcopy(gm), ctx)
    assert_expected_inline(
        _mlp_lines(aligned, ctx.spec),
        """\
linear_1 = linear: ['x.shape[0]', 64]
silu = silu: ['x.shape[0]', 64]
linear_2 = linear: ['x.shape[0]', 64]
mul = mul: ['x.shape[0]', 64]
linear_3 = linear: ['x.shape[0]', 16]
add_1 = add: ['x.shape[0]', 16]""",
    )
    padded = {
        user_name(node.name): node.meta[PADDED_SHAPE] for node in aligned.graph.nodes if PADDED_SHAPE in node.meta
    }
    assert_expected_inline(
        str(padded),
        """{'self.gate.weight': (64, 16), 'self.gate.bias': (64,), 'self.up.weight': (64, 16), 'self.up.bias': (64,), 'self.down.weight': (16, 64)}""",
    )


@pytest.fixture(scope="module")
def aligned():
    """``GatedBlock`` in float64, and the encoder that pads its misaligned matmuls (forced on the CPU)."""
    torch.manual_seed(0)
    model = GatedBlock().double().eval()
    compiled = vgraph_compile.encoder(
        model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa", compiler="eager", align_matmuls=True
    )
    return model, compiled


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
@settings(max_examples=10)
def test_aligned_encoder_is_exact(aligned, lengths):
    """Served with the zero-padded parameters, in float64: equal to the model up to summation order."""
    model, compiled = aligned
    inputs = pack_images(lengths, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-12, atol=1e-12)
    shapes = {tuple(value.shape) for value in compiled.vgraph.runtimes[0].buckets[0].inputs if torch.is_tensor(value)}
    assert {(64, 16), (64,), (16, 64)} <= shapes


def test_profitable_only_where_misaligned(traced):
    """Without forcing, a CPU graph is left alone: padding pays only for CUDA matmuls."""
    _, _, gm, ctx = traced
    ctx.config = VGraphConfig(token_budgets=(16, 64), max_segments=4, attention_backend="sdpa")
    aligned = align_matmuls.run(copy.deepcopy(gm), ctx)
    assert not any(PADDED_SHAPE in node.meta for node in aligned.graph.nodes)

