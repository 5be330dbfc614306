"""The FX helpers every stage shares: a call's name however it was spelled, in-place writes, schema arguments by
name, ancestors, and the pass wrapper that lints and recompiles."""

import operator

import pytest
import torch
import torch.fx

from vgraph_compile.fx_utils import (
    ancestors,
    apply_pass,
    callable_name,
    get_argument,
    op_name,
    set_argument,
    writes_in_place,
)

aten = torch.ops.aten


def _call(graph: torch.fx.Graph, target, *args, op="call_function", **kwargs) -> torch.fx.Node:
    return graph.create_node(op, target, args, kwargs)


@pytest.mark.parametrize(
    "op, target, name",
    [
        ("call_method", "cumsum", "cumsum"),
        ("call_function", torch.cumsum, "cumsum"),
        ("call_function", aten.cumsum.default, "cumsum"),
        ("call_function", aten.cumsum, "cumsum"),
        ("call_function", operator.add, "add"),
    ],
)
def test_a_call_is_named_the_same_however_it_was_spelled(op, target, name):
    graph = torch.fx.Graph()
    assert callable_name(_call(graph, target, graph.placeholder("x"), 0, op=op)) == name


def test_op_name_is_the_qualified_name_of_torch_ops_only():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    assert op_name(_call(graph, aten.cumsum.default, x, 0)) == "aten::cumsum"
    assert op_name(_call(graph, aten.cumsum, x, 0)) == "aten::cumsum"
    assert op_name(_call(graph, torch.cumsum, x, 0)) is None


@pytest.mark.parametrize(
    "op, target, in_place",
    [
        ("call_method", "add_", True),
        ("call_function", aten.add_.Tensor, True),
        ("call_function", operator.iadd, True),
        ("call_function", operator.and_, False),
        ("call_function", operator.add, False),
        ("call_method", "add", False),
    ],
)
def test_writes_in_place_are_the_underscore_calls_and_augmented_assignments(op, target, in_place):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    assert writes_in_place(_call(graph, target, x, x, op=op)) is in_place


def test_arguments_are_read_and_set_by_schema_name_where_they_were_passed():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    positional = _call(graph, aten.add.Tensor, x, x, 2)
    keyword = _call(graph, aten.add.Tensor, x, x, alpha=3)
    default = _call(graph, aten.add.Tensor, x, x)
    assert [get_argument(node, "alpha") for node in (positional, keyword, default)] == [2, 3, 1]
    set_argument(positional, "alpha", 5)
    set_argument(keyword, "alpha", 6)
    set_argument(default, "alpha", 7)
    assert (positional.args[2], keyword.kwargs["alpha"], default.kwargs["alpha"]) == (5, 6, 7)
    with pytest.raises(KeyError, match="has no argument 'beta'"):
        get_argument(positional, "beta")


def test_ancestors_are_each_dependency_once_itself_included():
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    both = _call(graph, operator.add, x, x)
    out = _call(graph, operator.mul, both, x)
    assert sorted(node.name for node in ancestors(out)) == sorted([out.name, both.name, "x"])
    assert y not in set(ancestors(out))


def test_apply_pass_recompiles_the_changed_graph():
    """The pass's edit (``add`` to ``mul``) is what the module runs afterwards."""
    gm = torch.fx.symbolic_trace(lambda x: x + x)

    def to_mul(gm, ctx):
        for node in gm.graph.find_nodes(op="call_function", target=operator.add):
            node.target = operator.mul
        return gm

    gm = apply_pass("to_mul", to_mul, gm, ctx=None)
    assert gm(torch.tensor(3.0)).item() == 9.0
