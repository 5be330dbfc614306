"""Input roles beyond the attention groups': integer inputs used as indices, then every other input.

Invariant: a role comes from how the graph uses an input, never from its name. Integer inputs reaching an index
that writes rows (``index_copy``, ``index_put``, ``scatter``, ``x[i] = ...``) are SCATTER_INDEX when the written
dim is as long as the index, PLACEMENT_INDEX when it is longer by positive multiples of sizes (patch rows and a
CLS row per image placed into ``patches + images`` rows); those reaching a read are GATHER_INDEX when the indexed
dim is symbolic, else TABLE_INDEX. The rest: SIZE for ints, PARAMETER for
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


def _extra_rows(written: sympy.Expr, length: sympy.Expr) -> sympy.Expr | None:
    """``written - length`` when it is a constant plus positive multiples of sizes (``images``, ``4 * images - 4``):
    then every size at most its bucket's keeps ``written_bucket - written >= length_bucket - length``, so the
    padded entries fit in the padding rows. None otherwise."""
    extra = sympy.expand(written - length)
    if not extra.free_symbols:
        return extra if extra.is_Integer else None
    try:
        poly = sympy.Poly(extra, *sorted(extra.free_symbols, key=str))
    except sympy.PolynomialError:
        return None
    if all(coefficient.is_Integer and (coefficient > 0 or not any(monomial)) for monomial, coefficient in poly.terms()):
        return extra
    return None


_VALUE_PRESERVING = {"long", "int", "to", "view", "reshape", "flatten", "contiguous"}


def _written_as_is(index_node: torch.fx.Node, input_node: torch.fx.Node) -> bool:
    """Whether the write's index holds the input's values unchanged (the input itself, cast or reshaped)."""
    node = index_node
    while node is not input_node:
        if node.op not in ("call_function", "call_method") or callable_name(node) not in _VALUE_PRESERVING:
            return False
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return False
    return True


def _write_role(
    index: int, index_node: torch.fx.Node, inputs: Inputs, written: sympy.Expr, simplify: Simplify
) -> InputRole:
    """SCATTER_INDEX for a 1-D index as long as the dim it writes, PLACEMENT_INDEX for one shorter by positive
    multiples of sizes that the write reads as is (shifted, its padded entries could reach real rows); a
    ValueError in the user's names otherwise."""
    node, value = inputs.nodes[index], example_value(inputs.nodes[index])
    name = inputs.name(index)
    extra = _extra_rows(written, simplify(value.shape[0])) if value.dim() == 1 else None
    if extra is None:
        raise ValueError(
            f"scatter index {name!r} (shape {tuple(value.shape)}) writes rows of a dim of {written} rows: vgraph "
            "pads 1-D indices that write a dim as long as themselves plus positive multiples of sizes (e.g. patch "
            "rows into patches + images rows), each padded entry then writing a padding row; compute other write "
            "positions in the encoder from cu_seqlens"
        )
    if extra == 0:
        return InputRole(index, node.name, Role.SCATTER_INDEX, (0,), indexed=written)
    if not _written_as_is(index_node, node):
        raise ValueError(
            f"scatter index {name!r} writes rows of a dim of {written} rows through {index_node.format_node()}: "
            "vgraph points its padded entries at the padding rows only when the write uses its values as they "
            f"are; pass the final row positions as {name!r}"
        )
    return InputRole(index, node.name, Role.PLACEMENT_INDEX, (0,), indexed=written)


def index_roles(
    gm: torch.fx.GraphModule, inputs: Inputs, taken: dict[int, InputRole], simplify: Simplify
) -> dict[int, InputRole]:
    """SCATTER_INDEX / PLACEMENT_INDEX / GATHER_INDEX / TABLE_INDEX roles of integer inputs used as indices (not
    already given a role); an input that both writes and reads is a SCATTER_INDEX or PLACEMENT_INDEX (its padding
    serves both; a PLACEMENT_INDEX must write and read dims of one size)."""
    roles: dict[int, InputRole] = {}
    for index_node, written_size in _write_uses(gm):
        written = simplify(written_size)
        for index in source_inputs(index_node, inputs)[0]:
            if index in taken or example_value(inputs.nodes[index]).dtype.is_floating_point:
                continue
            if index in roles:
                _check_same_dim(roles[index], written, inputs)
            elif written.free_symbols:
                roles[index] = _write_role(index, index_node, inputs, written, simplify)
    for index_node, indexed_size in _index_uses(gm):
        indexed = simplify(indexed_size)
        sources, _ = source_inputs(index_node, inputs)
        for index in sources:
            node, value = inputs.nodes[index], example_value(inputs.nodes[index])
            if index in taken or value.dtype.is_floating_point:
                continue
            if index in roles:
                _check_same_dim(roles[index], indexed, inputs)
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


def _check_same_dim(role: InputRole, indexed: sympy.Expr, inputs: Inputs) -> None:
    """A PLACEMENT_INDEX that also writes or reads another dim must find it as long as the first: its padded
    entries point past the first dim's real rows, which a shorter dim may not have."""
    if role.role is Role.PLACEMENT_INDEX and sympy.expand(role.indexed - indexed) != 0:
        raise ValueError(
            f"index {inputs.name(role.index)!r} writes a dim of {role.indexed} rows and indexes one of {indexed}: "
            "vgraph points its padded entries at padding rows of one dim size; index the other dim with its own "
            "input"
        )


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
