import torch

from tests.helpers import trace
from vgraph_compile.analyze import inputs
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


def _traced(static_widths: bool):
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    gm, ctx = trace(model, *pack_images([5, 8], 12), static_widths=static_widths)
    simplify = inputs.simplifier(ctx.shape_env)
    return gm, ctx, inputs.graph_inputs(gm, ctx), simplify


def test_module_state_is_told_apart_from_the_call_arguments():
    gm, ctx, graph_inputs, _ = _traced(static_widths=True)
    tensors = [i for i, value in enumerate(ctx.example_inputs) if isinstance(value, torch.Tensor)]
    arguments = [graph_inputs.name(i) for i in tensors if i not in graph_inputs.parameters]
    assert arguments == ["patches", "cu_seqlens"]
    assert len(graph_inputs.parameters) == len(tensors) - 2


def test_every_size_of_an_input_shape_is_read_somewhere_per_call():
    """Each symbol of the inputs' shapes has one binding (a dim of a tensor, or a lifted size int); the
    max_seqlen int binds its own symbol."""
    gm, ctx, graph_inputs, simplify = _traced(static_widths=True)
    sizes = inputs.input_sizes(graph_inputs, simplify)
    bound = [binding.symbol for binding in sizes.bindings]
    assert len(bound) == len(set(bound))
    assert set().union(*(size.free_symbols for shape in sizes.shapes for size in shape or ())) <= set(bound)
    max_seqlen = [i for i in range(len(graph_inputs.nodes)) if graph_inputs.name(i) == "max_seqlen"]
    assert [binding.dim for binding in sizes.bindings if binding.input in max_seqlen] == [None]


def _parameter_free(x, cu, max_seqlen):
    q = x.view(x.shape[0], 2, -1)
    return varlen_attention(q, q, q, cu, max_seqlen)


def test_trailing_dims_left_symbolic_are_feature_sizes_at_their_traced_values():
    """With no parameter to fix it, plain ``dynamic=True`` leaves the width of ``x`` symbolic: a feature size."""
    args = (torch.randn(12, 8), torch.tensor([0, 5, 12], dtype=torch.int32), 7)
    for static_widths, features in ((False, [8]), (True, [])):
        gm, ctx = trace(_parameter_free, *args, static_widths=static_widths)
        simplify = inputs.simplifier(ctx.shape_env)
        found = inputs.feature_sizes(inputs.graph_inputs(gm, ctx), simplify, ctx.shape_env)
        assert sorted(found.values()) == features
