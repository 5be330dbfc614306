from expecttest import assert_expected_inline

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
