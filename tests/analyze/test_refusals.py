import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.sample_models.packed_vit import pack_images
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.analyze import discover


def test_refuses_a_host_sync_inside_the_graph():
    def encoder(x, cu):
        q = x.view(x.shape[0], 1, -1)
        return varlen_attention(q, q, q, cu, int((cu[1:] - cu[:-1]).max().item()))

    gm, ctx = trace(encoder, torch.randn(6, 4), torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="data-dependent value"):
        discover.run(gm, ctx)


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


def test_a_relation_the_graph_lacks_is_asked_for_by_name():
    """A window permutation whose merge unit is inferred (``-1``: ``T // (T // 4)``, which is not 4 at every legal
    ``T``, e.g. 5 at ``T = 5``), flattened without a reshape back to the token count, leaves the rows a product of
    two sizes: the message names both inputs and gives the torch._check that ties them (ratio of the traced
    call)."""

    def encoder(x, cu, max_seqlen, window_index):
        permuted = x.reshape(x.shape[0] // 4, -1, x.shape[1])[window_index].flatten(0, 1)
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


def test_rows_the_trace_fixed_name_the_input_dims_it_fixed():
    """A plain trace (duck sizing) of a window permutation whose first call has as many merge units (12) as the
    patches are wide: ``window_index``'s length shares the width's symbol, which the linear fixes at 12, and the
    view's guards then fix the tokens at 48. The row count ``12 * (T // (T // 4))`` reduces to 48 by those guards
    (``symbolic.canonical``): a static trace, whose message names the input dim the trace fixed."""
    from vgraph_compile.spec import StaticTokensError

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(12, 8)

        def forward(self, x, cu, max_seqlen, window_index):
            x = self.embed(x)
            tokens, width = x.shape
            x = x.view(tokens // 4, 4, width)[window_index].reshape(tokens, width)
            return varlen_attention(*(x.view(tokens, 2, -1),) * 3, cu, max_seqlen)

    inputs = torch.randn(48, 12), torch.tensor([0, 16, 48], dtype=torch.int32), 32, torch.randperm(12)
    gm, ctx = trace(Encoder(), *inputs, plain=True)
    with pytest.raises(StaticTokensError, match=r"row count at 48 \(with window_index\.shape\[0\] == 12\): "):
        discover.run(gm, ctx)
