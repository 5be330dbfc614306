import pytest
import torch
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile

from tests.helpers import trace
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import pack_images
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.analyze import discover


def test_roles_from_data_flow(tiny):
    """Token rows, cu_seqlens and max_seqlen are told apart by how they reach the attention, not by names."""
    _, gm, ctx = tiny
    before = gm.code
    discover.run(gm, ctx)
    assert gm.code == before, "an analysis must not change the graph"
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: patches.shape[0]
group 0: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended']
input patches: tokens dims=[0]
input cu_seqlens: segment_offsets dims=[0] group=0
input max_seqlen: max_seqlen group=0
inputs: 18 parameters and module state (used in place)""",
    )


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


def test_refuses_a_host_sync_inside_the_graph():
    def encoder(x, cu):
        q = x.view(x.shape[0], 1, -1)
        return varlen_attention(q, q, q, cu, int((cu[1:] - cu[:-1]).max().item()))

    gm, ctx = trace(encoder, torch.randn(6, 4), torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="data-dependent value"):
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


def test_tokens_of_another_dtype_than_the_parameters_are_refused(tiny):
    """float64 patches into a float32 linear: refused at trace time, before any bucket compiles."""
    from torch._dynamo.exc import BackendCompilerFailed

    model, _, _ = tiny
    patches, cu, max_seqlen = pack_images([5, 8], 12)  # 13 tokens: not duck-sized with the width 12
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vgraph", dynamic=True, options={"token_budgets": [16]})
    message = "input 'patches' is torch.float64 but meets parameters of torch.float32"
    with pytest.raises(BackendCompilerFailed, match=message) as refused:
        compiled(patches.double(), cu, max_seqlen)
    assert isinstance(refused.value.inner_exception, ValueError)


def test_a_window_permutation_ties_tokens_to_the_index_length():
    """A reshape of [n, 4, d] back into [tokens, d] says tokens = 4 n: the graph gives the relation."""
    from vgraph_compile.models.examples import windowed_vit

    model, inputs = windowed_vit()
    gm, ctx = trace(model, *inputs, plain=True)
    discover.run(gm, ctx)
    assert_expected_inline(
        "\n".join(ctx.spec.format().splitlines()[:4]),
        """\
tokens: 4*window_index.shape[0]
relation: patches.shape[0] == 4*window_index.shape[0]
group 0: offsets=cu_window_seqlens segments=cu_window_seqlens.shape[0] - 1 sites=['attended']
group 1: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended_1']""",
    )


def test_a_relation_the_graph_lacks_is_asked_for_by_name():
    """A window permutation flattened without a reshape back to the token count leaves the rows a product of two
    sizes: the message names both inputs and gives the torch._check that ties them (ratio of the traced call)."""

    def encoder(x, cu, max_seqlen, window_index):
        permuted = x.reshape(x.shape[0] // 4, 4, -1)[window_index].flatten(0, 1)
        q = permuted.view(permuted.shape[0], 2, -1)
        return varlen_attention(q, q, q, cu, max_seqlen)

    inputs = (torch.randn(32, 6), torch.tensor([0, 16, 32], dtype=torch.int32), 16, torch.randperm(8))
    gm, ctx = trace(encoder, *inputs, plain=True)
    with pytest.raises(ValueError) as refused:
        discover.run(gm, ctx)
    assert_expected_inline(
        str(refused.value),
        """the attention's packed row count is window_index.shape[0]*((x.shape[0]//((x.shape[0]//4)))): vgraph bounds a sum of sizes (e.g. patches + one CLS row per image), and found no relation in the graph that reduces it to one. Tie the sizes in the encoder before the attention, e.g. torch._check(x.shape[0] == 4 * window_index.shape[0])""",
    )


class ScatterBack(torch.nn.Module):
    """Attention over permuted rows, then the rows written back to their places by the same index."""

    def forward(self, x, cu, max_seqlen, window_index):
        torch._check(window_index.shape[0] == x.shape[0])
        q = x.view(x.shape[0], 2, -1)[window_index]
        attended = varlen_attention(q, q, q, cu, max_seqlen)
        return torch.zeros_like(attended).index_copy(0, window_index, attended) + 1


def _scatter_inputs(lengths):
    x, cu, max_seqlen = pack_images(lengths, 8)
    return x, cu, max_seqlen, torch.randperm(x.shape[0])


def test_an_index_that_writes_is_a_scatter_index():
    gm, ctx = trace(ScatterBack(), *_scatter_inputs([5, 7]))
    discover.run(gm, ctx)
    assert "input window_index: scatter_index dims=[0]" in ctx.spec.format().splitlines()


@pytest.fixture(scope="module")
def scattering():
    """``ScatterBack`` compiled with one bucket of 64 rows, after a call that left NaN in its buffers."""
    model = ScatterBack()
    compiled = vgraph_compile.encoder(model, token_budgets=(64,), max_segments=4, compiler="eager")
    poisoned = _scatter_inputs([9, 3])
    with torch.no_grad():
        compiled(torch.full_like(poisoned[0], float("nan")), *poisoned[1:])
    return model, compiled


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_padded_scatter_entries_write_padding_rows_only(scattering, lengths):
    """In the bucket of 64 rows, the padded index entries write padded rows: every call (at most 80 rows) matches
    eager, even after a call that left NaN in the buffers; each call within 64 rows is served by the bucket."""
    model, compiled = scattering
    inputs = _scatter_inputs(lengths)
    fits = sum(lengths) <= 64
    with torch.no_grad(), counters.expect(replays=int(fits), eager_fallbacks=int(not fits)):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_offsets_end_at_the_rows_unless_the_graph_shifts_them(tiny):
    """Offsets read as is end at their sites' rows; a CLS encoder's cu_seqlens + arange ends at an unstated count."""
    from vgraph_compile.models.examples import cls_vit

    _, gm, ctx = tiny
    discover.run(gm, ctx)
    (group,) = ctx.spec.groups
    assert ctx.spec.describe_expr(group.ends_at) == "patches.shape[0]"
    model, inputs = cls_vit()
    gm, ctx = trace(model, *inputs)
    discover.run(gm, ctx)
    (group,) = ctx.spec.groups
    assert group.ends_at is None
