"""serve/split: which traces can be cut at a segment boundary, and that the two calls a cut makes, run through the
traced graph and joined, give the call's own outputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import trace
from vgraph_compile.analyze import discover
from vgraph_compile.sample_models.explain_factories import windowed_vit
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.serve.split import Splitter, can_split


def _traced(model, *args):
    gm, ctx = trace(model, *args)
    discover.run(gm, ctx)
    return gm, ctx


def _graph_inputs(ctx, patches, cu, max_seqlen):
    """The traced graph's inputs for a call of the packed encoder: the call's tensors and ints by role, the
    module state as traced (sizes: the token rows, or the offsets' length)."""
    values = {"tokens": patches, "segment_offsets": cu, "max_seqlen": max_seqlen}
    rows = {index: symbol == ctx.spec.token_rows for symbol, index, dim in ctx.spec.bindings if dim is None}
    sizes = {True: patches.shape[0], False: cu.shape[0]}
    return [
        values.get(role.role.value, sizes[rows[role.index]] if role.role.value == "size" else example)
        for role, example in zip(ctx.spec.inputs, ctx.example_inputs)
    ]


@pytest.fixture(scope="module")
def packed():
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    return _traced(model, *pack_images([5, 7, 3], 12))


def test_a_packed_encoder_splits_and_windowed_or_merged_ones_do_not(packed):
    """Legal: one group, every input per row or the offsets. Not legal: a window gather index and two groups
    (Qwen2.5-VL's layout), or outputs of merged rows (tokens / 4, not the token rows)."""
    assert can_split(packed[1].spec)
    model, inputs = windowed_vit()
    assert not can_split(_traced(model, *inputs)[1].spec)
    merged = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8, merge=4).eval()
    assert not can_split(_traced(merged, *pack_images([8, 12], 12))[1].spec)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=2, max_size=6), data=st.data())
def test_halves_joined_equal_the_whole_call(packed, lengths, data):
    """For any segments and any cut between two of them: the first half holds exactly the segments before the
    cut, the second the rest (offsets from 0), and the graph's outputs on the halves, joined, equal its outputs
    on the whole call (fp32, 1e-5)."""
    gm, ctx = packed
    splitter = Splitter(ctx.spec)
    args = _graph_inputs(ctx, *pack_images(lengths, 12))
    cu = args[splitter.offsets_input]
    segment = data.draw(st.integers(1, len(lengths) - 1))
    first, second = splitter.halves(args, cu.tolist(), segment)
    assert first[splitter.offsets_input].tolist() == [0, *torch.tensor(lengths[:segment]).cumsum(0).tolist()]
    assert second[splitter.offsets_input].tolist() == [0, *torch.tensor(lengths[segment:]).cumsum(0).tolist()]
    with torch.no_grad():
        whole = gm(*args)
        joined = splitter.join(gm(*first), gm(*second))
    for a, b in zip(joined, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
