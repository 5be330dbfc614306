"""The build's parameter binding: aligned weights share the module's storage where the module's strides allow."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph_compile
from tests.rewrite.test_align_matmuls import GatedBlock
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import pack_images

ROW_PADDED = ("gate.weight", "gate.bias", "up.weight", "up.bias")
"""Producers of the 60-wide region: padded along their first dim to 64, so their block is a contiguous view."""


def _compile(model, **options):
    compiled = vgraph_compile.encoder(
        model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa", align_matmuls=True, **options
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 16, dtype=next(model.parameters()).dtype))
    return compiled


def _bound(compiled) -> dict[int, torch.Tensor]:
    """The parameters the buckets run with, by the data pointer of their storage."""
    inputs = compiled.vgraph.runtimes[0].buckets[0].inputs
    return {value.untyped_storage().data_ptr(): value for value in inputs if isinstance(value, torch.Tensor)}


@pytest.fixture
def aligned():
    torch.manual_seed(0)
    model = GatedBlock().double().eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    return model, before, _compile(model, compiler="eager")


def test_row_padded_parameters_share_the_modules_storage(aligned):
    """gate and up (weights and biases) are views of the padded tensors the graphs read: one copy of them. down,
    padded along its columns, stays a copy (a view would change its strides, which dynamo guards)."""
    model, before, compiled = aligned
    bound = _bound(compiled)
    parameters = dict(model.named_parameters())
    for name in ROW_PADDED:
        parameter = parameters[name]
        padded = bound[parameter.untyped_storage().data_ptr()]
        assert parameter.data_ptr() == padded.data_ptr() and parameter.shape == before[name].shape, name
        assert padded.shape[0] == 64 and padded[60:].eq(0).all(), name
        assert parameter.is_contiguous() and torch.equal(parameter, before[name]), name
    down = parameters["down.weight"]
    assert down.untyped_storage().data_ptr() not in bound and down.is_contiguous()
    assert {tuple(value.shape) for value in bound.values()} >= {(64, 16), (64,), (16, 64)}


def test_state_dict_round_trips_and_eager_is_unchanged(aligned):
    """The module's state_dict keeps its shapes and values; a fresh module loaded from it computes what the
    compiled module's eager forward and its graphs compute, and the stock module's MLP still trains."""
    model, before, compiled = aligned
    state = model.state_dict()
    assert {name: tuple(value.shape) for name, value in state.items()} == {
        name: tuple(value.shape) for name, value in before.items()
    }
    fresh = GatedBlock().double().eval()
    fresh.load_state_dict(state)
    inputs = pack_images([3, 9, 4], 16, dtype=torch.float64)
    with torch.no_grad():
        expected = fresh(*inputs)
        torch.testing.assert_close(model(*inputs), expected, rtol=0, atol=0)
        torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-12, atol=1e-12)
    x = inputs[0].requires_grad_()  # the MLP only: the attention op has no autograd formula
    model.down(torch.nn.functional.silu(model.gate(x)) * model.up(x)).sum().backward()
    assert model.gate.weight.grad.shape == (60, 16) and model.down.weight.grad.shape == (16, 60)


def test_loaded_weights_reach_the_graphs(aligned):
    """load_state_dict writes into the shared storage: the graphs compute with the new gate and up weights (no
    retrace, no new buffers), and the padding stays zero."""
    model, _, compiled = aligned
    torch.manual_seed(1)
    other = GatedBlock().double().eval()
    other.down.load_state_dict(model.down.state_dict())  # down is a copy in the graphs: keep it
    model.load_state_dict(other.state_dict())
    inputs = pack_images([6, 2], 16, dtype=torch.float64)
    with torch.no_grad(), counters.expect(replays=1):
        torch.testing.assert_close(compiled(*inputs), other(*inputs), rtol=1e-12, atol=1e-12)
    assert all(padded[60:].eq(0).all() for padded in _bound(compiled).values() if padded.shape[0] == 64)


INDUCTOR_MODEL = None


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
@settings(max_examples=8, deadline=None)
def test_inductor_compiled_aligned_encoder_matches_eager(lengths):
    """The aligned graph compiled by inductor, fp32: every real row equals the eager module, served by a bucket."""
    global INDUCTOR_MODEL
    if INDUCTOR_MODEL is None:
        torch.manual_seed(0)
        model = GatedBlock().eval()
        INDUCTOR_MODEL = model, _compile(model)
    model, compiled = INDUCTOR_MODEL
    inputs = pack_images(lengths, 16)
    with torch.no_grad(), counters.expect(replays=1):
        out = compiled(*inputs)
    assert out.isfinite().all()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
