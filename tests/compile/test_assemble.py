"""The build's parameter binding: aligned weights share the module's storage (row-padded ones as contiguous
views; column-padded ones as strided views once the decorator serves past dynamo's guards, a copy for plain
torch.compile, whose guards read the strides)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph_compile
from tests.rewrite.test_align_matmuls import GatedBlock
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import pack_images

ROW_PADDED = ("gate.weight", "gate.bias", "up.weight", "up.bias")
"""Producers of the 60-wide region: padded along their first dim to 64, so their block is a contiguous view."""
COLUMN_PADDED = "down.weight"
"""The consumer: padded along its columns to 64, its block a view with row stride 64."""


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


def test_aligned_parameters_share_the_modules_storage(aligned):
    """gate and up (weights and biases) are contiguous views of the padded tensors the graphs read, and down a
    strided view of its column-padded one: every weight is held once, at the module's own shapes and values."""
    model, before, compiled = aligned
    bound = _bound(compiled)
    parameters = dict(model.named_parameters())
    for name in (*ROW_PADDED, COLUMN_PADDED):
        parameter = parameters[name]
        padded = bound[parameter.untyped_storage().data_ptr()]
        dim = int(name == COLUMN_PADDED)
        assert parameter.data_ptr() == padded.data_ptr() and parameter.shape == before[name].shape, name
        assert padded.shape[dim] == 64 and padded.narrow(dim, 60, 4).eq(0).all(), name
        assert torch.equal(parameter, before[name]), name
        assert parameter.is_contiguous() == (name != COLUMN_PADDED), name
    assert parameters[COLUMN_PADDED].stride() == (64, 1)
    assert {tuple(value.shape) for value in bound.values()} >= {(64, 16), (64,), (16, 64)}


def test_plain_torch_compile_keeps_the_column_padded_weight_a_copy():
    """Through torch.compile(backend=...) every call passes dynamo's guards on the parameters' strides: down keeps
    its own contiguous storage, and a second call replays with no new trace."""
    torch.manual_seed(0)
    model = GatedBlock().double().eval()
    config = vgraph_compile.VGraphConfig(
        token_budgets=(16, 64), max_segments=4, attention_backend="sdpa", align_matmuls=True, compiler="eager"
    )
    backend = vgraph_compile.VGraphBackend(config)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    # 1 site: its kernel set in the eager and compiled copies, plus 1 aligned region: 3 nodes rewritten.
    with torch.no_grad(), counters.expect(traces=1, sites_found=1, nodes_rewritten=3, buckets_built=2, replays=2):
        for lengths in ([5, 7], [9, 2]):
            inputs = pack_images(lengths, 16, dtype=torch.float64)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-12, atol=1e-12)
    assert model.down.weight.is_contiguous() and model.gate.weight.is_contiguous()
    storages = {value.untyped_storage().data_ptr() for value in backend.runtimes[0].buckets[0].inputs if
                isinstance(value, torch.Tensor)}  # fmt: skip
    assert model.down.weight.untyped_storage().data_ptr() not in storages
    assert model.gate.weight.untyped_storage().data_ptr() in storages


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
    """load_state_dict writes into the shared storage: the graphs compute with the new weights, down's strided
    view included (no retrace, no new buffers), and the padding stays zero."""
    model, _, compiled = aligned
    torch.manual_seed(1)
    other = GatedBlock().double().eval()
    model.load_state_dict(other.state_dict())
    inputs = pack_images([6, 2], 16, dtype=torch.float64)
    with torch.no_grad(), counters.expect(replays=1):
        torch.testing.assert_close(compiled(*inputs), other(*inputs), rtol=1e-12, atol=1e-12)
    assert all(padded[60:].eq(0).all() for padded in _bound(compiled).values() if padded.shape[0] == 64)
    assert _bound(compiled)[model.down.weight.untyped_storage().data_ptr()][:, 60:].eq(0).all()


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
