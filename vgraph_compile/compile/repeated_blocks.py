"""Compile the repeated block once: the blocks of a ``ModuleList`` become calls of one shared subgraph.

A ViT runs the same block 24-32 times. Inductor lowers, schedules and generates code for each copy anew; most of
a cold compile is that repetition. This pass, run on the rewritten graph just before inductor, finds the blocks in
the trace itself (no annotation), and routes each class of identical blocks through
``torch.ops.higher_order.invoke_subgraph`` with one identifier: aot_autograd traces the class's subgraph once
(its dispatch cache is keyed by the identifier) and inductor lowers it once (``ir.InvokeSubgraph``, one
``ir.Subgraph`` per ``get_attr``), then calls that code once per block.

Invariant: the graph computes exactly what it computed (the same ops on the same values, in the same order within
a block). A block's operands are what it reads from outside it: its parameters (still graph inputs, never baked
in), the hidden state, offsets, and the trace's size symbols. Two blocks share a subgraph only when they are
structurally identical: the same ops and targets in the same order, the same constant arguments (kernel choice,
scales, norm widths), each argument reading the same operand or the same earlier node of the block, and the same
operand metadata (dtype, shape and strides in the trace's symbols, device; a size operand's expression). Window
and full-attention blocks that read offsets of different lengths are then two classes, each compiled once.

Cases handled:
1. Blocks are the call nodes whose ``nn_module_stack`` names an entry ``<container>.<index>`` (the outermost such
   entry: a block's own sub-lists stay inside it). Each container is handled on its own.
2. A class with one block is left inline (sharing saves nothing).
3. Refused, left inline and logged: a block read by a node outside it before the block ends (a placement there
   would change the order); a block that writes in place; a block with an output that aliases an input or
   another output, or that is not a tensor; a block whose inputs' shapes read a size no graph input holds.

Before (two blocks of ``PackedViT``, graph inputs in the user's names)::

    layer_norm = layer_norm(x, (16,), self.blocks.0.norm1.weight, self.blocks.0.norm1.bias, 1e-05)
    ...  (16 nodes per block)
    x_2 = add(x_1, linear_4)
    layer_norm_2 = layer_norm(x_2, (16,), self.blocks.1.norm1.weight, self.blocks.1.norm1.bias, 1e-05)
    ...
    x_4 = add(x_3, linear_8)

After (the lifted size first, then what the block reads in order of first use)::

    invoke_subgraph = invoke_subgraph(repeated_block_0, 'blocks_0', cu_seqlens.shape[0], x,
        self.blocks.0.[norm1.weight norm1.bias qkv.weight qkv.bias], patches.shape[0], cu_seqlens, max_seqlen, ...)
    getitem = getitem(invoke_subgraph, 0)
    invoke_subgraph_1 = invoke_subgraph(repeated_block_0, 'blocks_0', cu_seqlens.shape[0], getitem,
        self.blocks.1.[norm1.weight ...], patches.shape[0], cu_seqlens, max_seqlen, ...)
    getitem_1 = getitem(invoke_subgraph_1, 0)
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.multiprocessing.reductions import StorageWeakRef

from vgraph_compile.compile.artifacts import describe_input
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import callable_name, example_value, writes_in_place

__all__ = ["Block", "find_blocks", "run", "SUBGRAPH_PREFIX"]

log = logging.getLogger(__name__)

SUBGRAPH_PREFIX = "repeated_block_"
"""Attribute name prefix of the shared subgraphs on the rewritten module."""

_ENTRY = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


@dataclass
class Block:
    """One entry of a module list, as a region of the graph."""

    container: str
    """The list's path in the traced module (``blocks``)."""
    index: int
    nodes: list[torch.fx.Node]
    """The block's call nodes, in graph order."""
    operands: list[torch.fx.Node]
    """Nodes outside the block that it reads, in order of first use, after the size inputs of their shapes."""
    outputs: list[torch.fx.Node]
    """The block's nodes read outside it, in graph order."""
    unbound: tuple[str, ...]
    """Symbols of the operands' shapes that no graph input holds (the block is then refused)."""

    @property
    def name(self) -> str:
        return f"{self.container}.{self.index}"


def _block_entry(node: torch.fx.Node) -> tuple[str, int] | None:
    """(container, index) of the outermost module-list entry ``node`` was traced in, else None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _ENTRY.match(path)
        if match is not None:
            container = re.sub(r"^L\['self'\]\.", "", match["container"])
            return container, int(match["index"])
    return None


def _size_inputs(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, torch.fx.Node]:
    """The graph's size inputs by their symbol (dynamo passes every size a shape reads as such an input)."""
    sizes = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        value = example_value(node)
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            sizes[value.node.expr] = node
    return sizes


def _region(
    container: str, index: int, nodes: list[torch.fx.Node], sizes: dict[sympy.Symbol, torch.fx.Node]
) -> Block:
    """The block of ``nodes``. Its operands start with the size inputs of every symbol in the other operands'
    shapes and strides (sorted by name): inductor binds a subgraph's symbols from its own inputs only, so a shape
    such as ``4*s48`` needs ``s48`` passed in, as dynamo does for a ``nested_compile_region``."""
    inside = set(nodes)
    read: dict[torch.fx.Node, None] = {}
    for node in nodes:
        for argument in node.all_input_nodes:
            if argument not in inside:
                read.setdefault(argument)
    symbols: set[sympy.Symbol] = set()
    for value in map(example_value, read):
        if isinstance(value, (torch.Tensor, torch.SymInt)):
            symbols |= free_symbols(value)
    ordered = sorted(symbols, key=str)
    lifted = [sizes[symbol] for symbol in ordered if symbol in sizes and sizes[symbol] not in read]
    unbound = tuple(str(symbol) for symbol in ordered if symbol not in sizes)
    outputs = [node for node in nodes if any(user not in inside for user in node.users)]
    return Block(container, index, nodes, lifted + list(read), outputs, unbound)


def find_blocks(gm: torch.fx.GraphModule) -> list[Block]:
    """Every module-list entry's region of ``gm``, by container then index (an analysis: ``gm`` is not changed)."""
    regions: dict[tuple[str, int], list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            entry = _block_entry(node)
            if entry is not None:
                regions.setdefault(entry, []).append(node)
    sizes = _size_inputs(gm)
    return [_region(container, index, nodes, sizes) for (container, index), nodes in sorted(regions.items())]


def _refusal(block: Block, position: dict[torch.fx.Node, int]) -> str | None:
    """Why ``block`` cannot become one call, or None."""
    if block.unbound:
        return f"its inputs' shapes read sizes no graph input holds ({', '.join(block.unbound)})"
    last = position[block.nodes[-1]]
    inside = set(block.nodes)
    for node in block.nodes:
        early = [user for user in node.users if user not in inside and position[user] < last]
        if early:
            return f"{early[0].name} reads {node.name} before the block ends"
        mutable = isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        if mutable or writes_in_place(node) or callable_name(node) == "setitem":
            return f"{node.name} writes in place"
    storages = set()
    for node in block.operands:
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            storages.add(StorageWeakRef(value.untyped_storage()))
    for node in block.outputs:
        value = example_value(node)
        if not isinstance(value, torch.Tensor):
            return f"its output {node.name} is not a tensor"
        storage = StorageWeakRef(value.untyped_storage())
        if storage in storages:
            return f"its output {node.name} aliases an input or another output"
        storages.add(storage)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.SymInt):
        return f"SymInt {value.node.expr}"
    return describe_input(value)


def _signature(block: Block) -> tuple:
    """What makes two blocks the same computation: each node's op, target and arguments (operands and the block's
    own nodes by position), and each operand's metadata."""
    local = {node: ("operand", i) for i, node in enumerate(block.operands)}
    local.update({node: ("node", i) for i, node in enumerate(block.nodes)})
    rename = lambda argument: local[argument]  # noqa: E731
    body = tuple(
        (
            node.op,
            node.target,
            repr(torch.fx.node.map_arg(node.args, rename)),
            repr(torch.fx.node.map_arg(node.kwargs, rename)),
        )
        for node in block.nodes
    )
    outputs = tuple(local[node] for node in block.outputs)
    return body, outputs, tuple(_describe(example_value(node)) for node in block.operands)


def _subgraph(gm: torch.fx.GraphModule, block: Block) -> torch.fx.GraphModule:
    """``block`` as a graph of its operands, returning its outputs as a tuple (the trace's names kept)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for operand in block.operands:
        env[operand] = graph.placeholder(operand.name)
        env[operand].meta = dict(operand.meta)
    for node in block.nodes:
        env[node] = graph.node_copy(node, lambda argument: env[argument])
    graph.output(tuple(env[node] for node in block.outputs))
    return torch.fx.GraphModule(gm, graph)


def _call(
    gm: torch.fx.GraphModule, block: Block, attribute: str, identifier: str, replaced: dict[torch.fx.Node, torch.fx.Node]
) -> None:
    """Replace ``block``'s nodes by one ``invoke_subgraph`` call at the position of its last node; ``replaced``
    maps the outputs of blocks replaced before to the nodes that now hold them (and gets this block's)."""
    graph = gm.graph
    operands = [replaced.get(node, node) for node in block.operands]
    with graph.inserting_after(block.nodes[-1]):
        subgraph = graph.get_attr(attribute)
    with graph.inserting_after(subgraph):
        call = graph.call_function(
            torch.ops.higher_order.invoke_subgraph, (subgraph, identifier, *operands)
        )
    call.meta["example_value"] = tuple(example_value(node) for node in block.outputs)
    previous = call
    for position, output in enumerate(block.outputs):
        with graph.inserting_after(previous):
            previous = graph.call_function(operator.getitem, (call, position))
        previous.meta["example_value"] = example_value(output)
        output.replace_all_uses_with(previous)
        replaced[output] = previous
    for node in reversed(block.nodes):
        graph.erase_node(node)


def run(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every class of two or more identical blocks called through one shared subgraph (in place)."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    classes: dict[tuple, list[Block]] = {}
    for block in find_blocks(gm):
        why = _refusal(block, position)
        if why is not None:
            log.info("vgraph: block %s is compiled inline: %s", block.name, why)
            continue
        classes.setdefault((block.container, _signature(block)), []).append(block)
    repeated = [members for members in classes.values() if len(members) > 1]
    subgraphs = [_subgraph(gm, members[0]) for members in repeated]  # before any block is replaced
    shared, replaced = 0, {}
    for number, (members, subgraph) in enumerate(zip(repeated, subgraphs)):
        attribute = f"{SUBGRAPH_PREFIX}{number}"
        gm.add_submodule(attribute, subgraph)
        identifier = f"{re.sub(r'[^0-9A-Za-z_]', '_', members[0].container)}_{number}"
        for block in members:
            _call(gm, block, attribute, identifier, replaced)
        shared += len(members)
        log.info("vgraph: %s compile once, as %s", ", ".join(block.name for block in members), identifier)
    counters.blocks_compiled_once += shared
    if shared:
        gm.graph.lint()
        gm.recompile()
    return gm
