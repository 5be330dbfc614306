"""Input roles beyond the attention groups': integer inputs used as indices, then every other input.

Invariant: a role comes from how the graph uses an input, never from its name. Integer inputs reaching an index
that writes rows (``index_copy``, ``index_put``, ``scatter``, ``x[i] = ...``) are SCATTER_INDEX; those reaching a
read are GATHER_INDEX when the indexed dim is symbolic, else TABLE_INDEX. The rest: SIZE for ints, PARAMETER for
module state, TOKENS for tensors with a symbolic dim, STATIC otherwise.
"""

from __future__ import annotations

import operator
from typing import Iterator

import sympy
import torch
import torch.fx

from vgraph_compile.analyze.inputs import Inputs, Simplify, source_inputs
from vgraph_compile.fx_utils import callable_name, example_value
from vgraph_compile.spec import InputRole, Role

__all__ = ["index_roles", "other_roles"]


def _index_uses(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, object]]:
    """(index node, size of the indexed dim) for every tensor used as a gather index."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = callable_name(node)
        if node.target is operator.getitem and isinstance(example_value(node.args[0]), torch.Tensor):
            indices = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            table = example_value(node.args[0])
            for dim, index in enumerate(indices):
                if isinstance(index, torch.fx.Node) and isinstance(example_value(index), torch.Tensor):
                    yield index, table.shape[dim]
        elif name == "index_select":
            table, dim, index = example_value(node.args[0]), node.args[1], node.args[2]
            yield index, table.shape[dim]
        elif name == "embedding":
            yield node.args[0], example_value(node.args[1]).shape[0]


_WRITERS = {"index_copy", "index_copy_", "index_put", "index_put_", "scatter", "scatter_", "setitem"}


def _write_uses(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, object]]:
    """(index node, size of the written dim) for every tensor used as an index that writes rows."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or callable_name(node) not in _WRITERS:
            continue
        name, args = callable_name(node), node.args
        target = example_value(args[0])
        if not isinstance(target, torch.Tensor):
            continue
        if name in ("index_put", "index_put_", "setitem"):
            indices = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            for dim, index in enumerate(indices):
                if isinstance(index, torch.fx.Node) and isinstance(example_value(index), torch.Tensor):
                    yield index, target.shape[dim]
        else:
            dim, index = args[1], args[2]
            if isinstance(index, torch.fx.Node):
                yield index, target.shape[dim]


def index_roles(
    gm: torch.fx.GraphModule, inputs: Inputs, taken: dict[int, InputRole], simplify: Simplify
) -> dict[int, InputRole]:
    """SCATTER_INDEX / GATHER_INDEX / TABLE_INDEX roles of integer inputs used as indices (not already
    given a role); an input that both writes and reads is a SCATTER_INDEX (its padding serves both)."""
    roles: dict[int, InputRole] = {}
    for index_node, written_size in _write_uses(gm):
        written = simplify(written_size)
        for index in source_inputs(index_node, inputs)[0]:
            node, value = inputs.nodes[index], example_value(inputs.nodes[index])
            if index in taken or index in roles or value.dtype.is_floating_point or not written.free_symbols:
                continue
            length = simplify(value.shape[0]) if value.dim() == 1 else None
            if length is None or sympy.simplify(length - written) != 0:
                raise ValueError(
                    f"scatter index {inputs.name(index)!r} (shape {tuple(value.shape)}) writes rows of a dim of "
                    f"{written} rows: vgraph pads 1-D indices that write a dim exactly as long as themselves (each "
                    "padded entry then writes a padding row); compute other write positions in the encoder from "
                    "cu_seqlens"
                )
            roles[index] = InputRole(index, node.name, Role.SCATTER_INDEX, (0,), indexed=written)
    for index_node, indexed_size in _index_uses(gm):
        indexed = simplify(indexed_size)
        sources, _ = source_inputs(index_node, inputs)
        for index in sources:
            node, value = inputs.nodes[index], example_value(inputs.nodes[index])
            if index in taken or index in roles or value.dtype.is_floating_point:
                continue
            role = Role.GATHER_INDEX if indexed.free_symbols else Role.TABLE_INDEX
            dims = tuple(d for d, size in enumerate(value.shape) if not isinstance(size, int))
            if role is Role.GATHER_INDEX and value.dim() != 1:
                raise ValueError(
                    f"gather index {inputs.name(index)!r} has shape {tuple(value.shape)}: "
                    "vgraph pads 1-D permutation indices only; flatten it before indexing"
                )
            roles[index] = InputRole(index, node.name, role, dims, indexed=indexed if dims else None)
    return roles


def other_roles(inputs: Inputs, taken: dict[int, InputRole], simplify: Simplify) -> dict[int, InputRole]:
    """The roles of the inputs ``taken`` lacks: SIZE, STATIC, PARAMETER or TOKENS (with its symbolic dims)."""
    roles = {}
    for index, node in enumerate(inputs.nodes):
        if index in taken:
            continue
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            roles[index] = InputRole(index, node.name, Role.SIZE)
        elif not isinstance(value, torch.Tensor):
            roles[index] = InputRole(index, node.name, Role.STATIC)
        else:
            symbolic = tuple(d for d, size in enumerate(value.shape) if simplify(size).free_symbols)
            role = Role.PARAMETER if index in inputs.parameters else Role.TOKENS if symbolic else Role.STATIC
            roles[index] = InputRole(index, node.name, role, symbolic)
    return roles
