"""The per-call checks of one traced encoder: the plan a call's sizes decide, cached per distinct sizes, and the
refusals in the user's names. The messages the README's bad-input table lists are checked end to end in
``tests/test_bad_input.py``; the checks and plans are called here on the graph inputs dynamo would pass."""

import dataclasses

import pytest
import torch

from tests.helpers import trace
from vgraph_compile.analyze import analyze
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.serve.call_checks import CallChecks

torch.manual_seed(0)
MODEL = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()


@pytest.fixture(scope="module")
def traced():
    """The analysed trace of ``MODEL``, and the graph inputs dynamo would pass for a call of ``MODEL``."""
    gm, ctx = trace(MODEL, *pack_images([5, 7], 12))
    analyze(gm, ctx)
    index = {ctx.spec.describe_input(position): position for position in range(len(ctx.example_inputs))}
    symbolic = [node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")]

    def graph_inputs(patches, cu_seqlens, max_seqlen):
        call = {"patches": patches, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        sizes = {}  # a traced size symbol -> its value in this call
        for name, value in call.items():
            traced_value = symbolic[index[name]]
            if isinstance(value, torch.Tensor) and isinstance(traced_value, torch.Tensor):
                for dim, size in enumerate(traced_value.shape[: value.dim()]):
                    if isinstance(size, torch.SymInt):
                        sizes[size.node.expr] = value.shape[dim]
        inputs = list(ctx.example_inputs)
        for position, traced_value in enumerate(symbolic):
            name = ctx.spec.describe_input(position)
            if name in call:
                inputs[position] = call[name]
            elif isinstance(traced_value, torch.SymInt):
                inputs[position] = sizes[traced_value.node.expr]
        return inputs

    return ctx, graph_inputs


def _index(ctx, name):
    return next(index for index in range(len(ctx.example_inputs)) if ctx.spec.describe_input(index) == name)


def test_a_plan_holds_the_calls_token_rows_where_cu_seqlens_ends_and_the_output_rows(traced):
    ctx, graph_inputs = traced
    checks = CallChecks.from_context(ctx)
    for lengths in ([5, 7], [3, 4, 9], [1]):
        plan = checks.check(graph_inputs(*pack_images(lengths, 12)))
        tokens = sum(lengths)
        assert plan.tokens == tokens
        assert plan.ends == {_index(ctx, "cu_seqlens"): tokens}
        assert plan.narrow == (((0, tokens),),)


def test_plans_are_computed_once_per_distinct_sizes(traced):
    ctx, graph_inputs = traced
    checks = CallChecks.from_context(ctx)
    first = checks.check(graph_inputs(*pack_images([5, 7], 12)))
    assert checks.check(graph_inputs(*pack_images([5, 7], 12))) is first
    assert checks.check(graph_inputs(*pack_images([7, 5], 12))) is first  # same sizes, other segment lengths
    assert checks.check(graph_inputs(*pack_images([5, 8], 12))) is not first


def test_an_input_that_is_no_tensor_is_refused_by_its_name(traced):
    ctx, graph_inputs = traced
    inputs = graph_inputs(*pack_images([5, 7], 12))
    inputs[_index(ctx, "patches")] = inputs[_index(ctx, "patches")].tolist()
    with pytest.raises(ValueError, match="patches must be a tensor, got list"):
        CallChecks.from_context(ctx).check(inputs)


def test_cu_seqlens_of_one_entry_is_refused_with_its_form(traced):
    ctx, graph_inputs = traced
    patches, _, _ = pack_images([5, 7], 12)
    inputs = graph_inputs(patches, torch.tensor([0], dtype=torch.int32), 7)
    message = r"cu_seqlens must be 1-D with at least 2 entries \[0, ..., tokens\], got shape \(1,\)"
    with pytest.raises(ValueError, match=message):
        CallChecks.from_context(ctx).check(inputs)


def test_check_values_off_skips_the_offsets_values_but_not_dtypes(traced):
    """``check_values=False`` reads no offsets back from the device; the dtype, device and shape checks stay."""
    ctx, graph_inputs = traced
    unchecked_config = dataclasses.replace(ctx.config, check_values=False)
    unchecked = CallChecks.from_context(dataclasses.replace(ctx, config=unchecked_config))
    patches, _, _ = pack_images([5, 7], 12)
    decreasing = torch.tensor([0, 7, 5, 12], dtype=torch.int32)
    assert unchecked.check(graph_inputs(patches, decreasing, 7)).tokens == 12
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease"):
        CallChecks.from_context(ctx).check(graph_inputs(patches, decreasing, 7))
    with pytest.raises(ValueError, match=r"patches is torch.float64 on cpu, but .* compiled for torch.float32"):
        unchecked.check(graph_inputs(patches.double(), decreasing, 7))
