from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.analyze import discover


def test_a_window_permutation_ties_tokens_to_the_index_length():
    """A reshape of [n, 4, d] back into [tokens, d] says tokens = 4 n: the graph gives the relation."""
    from vgraph_compile.sample_models.explain_factories import windowed_vit

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
