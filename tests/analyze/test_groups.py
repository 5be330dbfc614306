import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.sample_models.packed_vit import pack_images
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.analyze import discover


class TwoGroups(torch.nn.Module):
    """Full attention over frames, then window attention, and a window permutation (a gather index)."""

    def forward(self, x, cu_full, max_full, cu_window, max_window, window_index):
        q = x.view(x.shape[0], 2, -1)
        full = varlen_attention(q, q, q, cu_full, max_full)
        permuted = full[window_index]
        window = varlen_attention(permuted, permuted, permuted, cu_window, max_window)
        return window.reshape(x.shape[0], -1), torch.nn.functional.embedding(window_index, torch.ones(64, 3))


def test_groups_and_index_roles():
    x = torch.randn(32, 8)
    cu_full = torch.tensor([0, 16, 32], dtype=torch.int32)
    cu_window = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)
    gm, ctx = trace(TwoGroups(), x, cu_full, 16, cu_window, 8, torch.randperm(32))
    discover.run(gm, ctx)
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: x.shape[0]
group 0: offsets=cu_full segments=cu_full.shape[0] - 1 sites=['full']
group 1: offsets=cu_window segments=cu_window.shape[0] - 1 sites=['window']
input x: tokens dims=[0]
input cu_full: segment_offsets dims=[0] group=0
input max_full: max_seqlen group=0
input window_index: gather_index dims=[0]
input cu_window: segment_offsets dims=[0] group=1
input max_window: max_seqlen group=1
inputs: 0 parameters and module state (used in place)""",
    )


def test_refuses_a_graph_without_varlen_attention():
    gm, ctx = trace(lambda x, cu: x * 2 + cu.sum(), torch.randn(6, 4), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="no varlen-attention call found"):
        discover.run(gm, ctx)


def test_refuses_int64_cu_seqlens(tiny):
    model, _, _ = tiny
    patches, cu, max_seqlen = pack_images([5, 7], 12)
    gm, ctx = trace(model, patches, cu.long(), max_seqlen)
    with pytest.raises(ValueError, match="is torch.int64: varlen kernels read int32 offsets"):
        discover.run(gm, ctx)


def _encoder(x, cu, max_seqlen):
    q = x.view(x.shape[0], 2, -1)
    return varlen_attention(q, q, q, cu.reshape(-1), int(max_seqlen))


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(12, 8), torch.tensor([0, 5, 12], dtype=torch.float32), 7), "'cu' is torch.float32"),
        ((torch.randn(12, 8), torch.tensor([[0, 5, 12]], dtype=torch.int32), 7), "'cu' is 2-D"),
    ],
    ids=["float cu_seqlens", "2-D cu_seqlens"],
)
def test_bad_inputs_are_refused_in_the_users_names(args, message):
    gm, ctx = trace(_encoder, *args)
    with pytest.raises(ValueError, match=message):
        discover.run(gm, ctx)


def test_a_float_max_seqlen_is_refused_through_torch_compile():
    """Plain torch.compile keeps floats symbolic: a float max_seqlen reaches the analysis, which names it."""
    from torch._dynamo.exc import BackendCompilerFailed

    torch._dynamo.reset()
    compiled = torch.compile(_encoder, backend="vgraph", dynamic=True, options={"token_budgets": [16]})
    with pytest.raises(BackendCompilerFailed, match="max_seqlen input 'max_seqlen' is a float") as refused:
        compiled(torch.randn(12, 8), torch.tensor([0, 5, 12], dtype=torch.int32), 7.0)
    assert isinstance(refused.value.inner_exception, ValueError)


def test_offsets_end_at_the_rows_unless_the_graph_shifts_them(tiny):
    """Offsets read as is end at their sites' rows; a CLS encoder's cu_seqlens + arange ends at an unstated count."""
    from vgraph_compile.sample_models.explain_factories import cls_vit

    _, gm, ctx = tiny
    discover.run(gm, ctx)
    (group,) = ctx.spec.groups
    assert ctx.spec.describe_expr(group.ends_at) == "patches.shape[0]"
    model, inputs = cls_vit()
    gm, ctx = trace(model, *inputs)
    discover.run(gm, ctx)
    (group,) = ctx.spec.groups
    assert group.ends_at is None
