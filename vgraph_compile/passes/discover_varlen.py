"""Analysis: find the varlen-attention sites and give every graph input a role, from data flow alone.

Invariant: never mutates the graph; stores a ``VarlenSpec`` in ``ctx.spec``.

Cases handled:
1. Sites: ``vgraph::varlen_attention``, ``torch_attn::_varlen_attn`` (torch's varlen FA2) and flash-attn's
   ``flash_attn::_flash_attn_varlen_forward``, looked up by schema name in ``VARLEN_OPS``.
2. A site's cu_seqlens is followed back to the one graph input it comes from; sites sharing that input form an
   attention group. A path through ``cumsum`` means the input holds lengths, otherwise offsets.
3. A site's max_seqlen, when symbolic, marks the int inputs it comes from as that group's MAX_SEQLEN.
4. Integer inputs reaching an index argument are GATHER_INDEX when the indexed dim is symbolic, else TABLE_INDEX.
5. Budgets count the packed rows of the first site (the token expression); other sites may attend over rows
   that other roles bound (e.g. a window permutation). Tensors with a symbolic dim are TOKENS; module state is
   PARAMETER; other tensors STATIC; other ints SIZE. Feature widths left symbolic are recorded at their value.
6. Refused with a ValueError: no site, a data-dependent value (``.item()``/``.tolist()`` would sync the host
   inside a graph), cu_seqlens not int32 or not traceable to one input. A trace whose token count is a constant
   raises ``StaticTokensError`` (the backend runs it eagerly and says how to get a dynamic trace).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx
from torch._dynamo import source as dynamo_source
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from vgraph_compile.counters import counters
from vgraph_compile.passes.fx_utils import ancestors, example_value, get_argument, op_name, traced_values
from vgraph_compile.passes.spec import AttentionGroup, InputRole, PassContext, Role, VarlenSite, VarlenSpec

__all__ = ["run", "VARLEN_OPS", "VarlenOp", "StaticTokensError"]

log = logging.getLogger(__name__)


class StaticTokensError(ValueError):
    """The trace fixed the attention's row count: it serves one token count only."""


@dataclass(frozen=True)
class VarlenOp:
    """Where a varlen-attention op keeps its arguments (schema names)."""

    q: str
    cu_seqlens: tuple[str, ...]
    max_seqlen: tuple[str, ...]
    backend: str | None = None
    """Argument naming the kernel, rewritten per config (vgraph's own ops only)."""
    packed: bool = False
    """Its offsets are FlashInfer's packed ``[Q/K/O | V]`` element offsets (two halves of segments + 1)."""


VARLEN_OPS: dict[str, VarlenOp] = {
    "vgraph::varlen_attention": VarlenOp("q", ("cu_seqlens",), ("max_seqlen",), backend="backend"),
    "vgraph::packed_varlen_attention": VarlenOp(
        "q", ("packed_offsets",), ("max_seqlen",), backend="backend", packed=True
    ),
    "torch_attn::_varlen_attn": VarlenOp("query", ("cu_seq_q", "cu_seq_k"), ("max_q", "max_k")),
    "flash_attn::_flash_attn_varlen_forward": VarlenOp(
        "q", ("cu_seqlens_q", "cu_seqlens_k"), ("max_seqlen_q", "max_seqlen_k")
    ),
}

_OFFSET_PASSTHROUGH = {"to", "int", "long", "contiguous", "clone", "view", "reshape", "flatten", "type"}
_INDEX_TAKERS = {"index_select", "embedding"}


def _expr(value) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(value)


def _module_state(source) -> bool:
    module_sources = (
        dynamo_source.NNModuleSource,
        dynamo_source.UnspecializedNNModuleSource,
        dynamo_source.UnspecializedBuiltinNNModuleSource,
        dynamo_source.ParamBufferSource,
        dynamo_source.UnspecializedParamBufferSource,
    )
    while source is not None:
        if isinstance(source, module_sources):
            return True
        source = getattr(source, "base", None)
    return False


def _callable_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = op_name(node)
    if name is not None:
        return name.split("::")[-1]
    return getattr(node.target, "__name__", str(node.target))


def _check_no_host_sync(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        value = example_value(node)
        unbacked = free_unbacked_symbols(value) if value is not None else set()
        if unbacked:
            raise ValueError(
                f"node {node.format_node()} produces a data-dependent value {sorted(map(str, unbacked))} "
                "(e.g. .item(), .tolist(), nonzero): a CUDA graph cannot read device data on the host. "
                "Compute it on the host and pass it to the encoder as an input (Python int or tensor)."
            )


def _source_input(start: torch.fx.Node, placeholders: dict[torch.fx.Node, int], parameters: set[int]):
    """The single non-parameter input ``start`` is computed from, and whether the path has a cumsum."""
    sources = []
    has_cumsum = False
    for node in ancestors(start):
        if node in placeholders and placeholders[node] not in parameters:
            if isinstance(example_value(node), torch.Tensor):
                sources.append(node)
        elif node.op in ("call_function", "call_method"):
            name = _callable_name(node)
            has_cumsum |= name == "cumsum"
    return sources, has_cumsum


def _index_uses(gm: torch.fx.GraphModule):
    """(index node, size of the indexed dim) for every tensor used as an index."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _callable_name(node)
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


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    _check_no_host_sync(gm)
    shape_env = ctx.shape_env
    placeholder_nodes = list(gm.graph.find_nodes(op="placeholder"))
    placeholders = {node: index for index, node in enumerate(placeholder_nodes)}
    parameters = {
        index
        for index, node in enumerate(placeholder_nodes)
        if isinstance(ctx.example_inputs[index], torch.nn.Parameter)
        or _module_state(getattr(node, "_dynamo_source", None))
    }

    def simplify(value) -> sympy.Expr:
        return sympy.sympify(shape_env.replace(_expr(value)))

    roles: dict[int, InputRole] = {}
    sites: list[VarlenSite] = []
    groups: dict[int, dict] = {}
    for node in gm.graph.nodes:
        name = op_name(node) if node.op == "call_function" else None
        if name not in VARLEN_OPS:
            continue
        op = VARLEN_OPS[name]
        rows = simplify(example_value(get_argument(node, op.q)).shape[0])
        offsets_inputs = set()
        lengths = False
        for argument in op.cu_seqlens:
            cu = get_argument(node, argument)
            if cu is None:
                continue
            sources, has_cumsum = _source_input(cu, placeholders, parameters)
            if len(sources) != 1:
                names = [source.name for source in sources]
                raise ValueError(
                    f"{argument} of {node.format_node()} comes from inputs {names}, not from exactly one input: "
                    "pass the int32 cu_seqlens (prefix sums of segment lengths) to the encoder as an input"
                )
            source = sources[0]
            value = example_value(source)
            if not has_cumsum and value.dtype != torch.int32:
                raise ValueError(
                    f"cu_seqlens input {source.name!r} is {value.dtype}: varlen kernels read int32 offsets; "
                    "build it with dtype=torch.int32"
                )
            offsets_inputs.add(placeholders[source])
            lengths |= has_cumsum
        if len(offsets_inputs) != 1:
            raise ValueError(f"q and k offsets of {node.format_node()} come from different inputs; vgraph needs one")
        (offsets_index,) = offsets_inputs
        group = groups.setdefault(
            offsets_index, {"index": len(groups), "max": set(), "sites": [], "lengths": lengths, "packed": op.packed}
        )
        group["sites"].append(node.name)
        for argument in op.max_seqlen:
            bound = get_argument(node, argument)
            if isinstance(bound, torch.fx.Node):
                for source in ancestors(bound):
                    if source in placeholders and isinstance(example_value(source), torch.SymInt):
                        group["max"].add(placeholders[source])
        sites.append(VarlenSite(node.name, name, group["index"], rows))
        counters.sites_found += 1

    if not sites:
        known = ", ".join(VARLEN_OPS)
        raise ValueError(
            f"no varlen-attention call found in the traced graph (looked for {known}): route the encoder's "
            "attention through vgraph_compile.varlen_attention(q, k, v, cu_seqlens, max_seqlen)"
        )
    features = _feature_sizes(placeholder_nodes, parameters, simplify, shape_env)
    token_rows = sympy.sympify(sites[0].rows.xreplace(features))
    token_free = sorted(token_rows.free_symbols, key=str)
    if not token_free:
        raise StaticTokensError(
            f"the trace fixed the attention's packed row count at {token_rows}: without dynamic=True, or with "
            "duck sizing (a first call whose token count equals another size) or a first call of one token, "
            "dynamo specializes it. Use vgraph_compile.encoder, which traces with neither."
        )
    if len(token_free) != 1:
        raise ValueError(
            f"the attention's packed row count is {token_rows}: it must depend on exactly one dynamic size. "
            "Compile with torch.compile(..., dynamic=True) or vgraph_compile.encoder so token dims are symbolic"
        )
    (token_symbol,) = token_free
    for guard in shape_env.guards:
        expr = sympy.sympify(shape_env.replace(guard.expr))
        if (
            isinstance(expr, sympy.Eq)
            and {expr.lhs, expr.rhs} & {token_symbol}
            and (expr.lhs.is_Integer or expr.rhs.is_Integer)
        ):
            raise StaticTokensError(
                f"the trace pinned the token count with the guard {expr} (a first call of one token takes some "
                "paths that only hold at that size); the next call of another size retraces"
            )

    attention_groups = []
    for offsets_index, group in groups.items():
        length = simplify(example_value(placeholder_nodes[offsets_index]).shape[0])
        role = (
            Role.PACKED_OFFSETS
            if group["packed"]
            else Role.SEGMENT_LENGTHS
            if group["lengths"]
            else Role.SEGMENT_OFFSETS
        )
        roles[offsets_index] = InputRole(
            offsets_index,
            placeholder_nodes[offsets_index].name,
            role,
            (0,) if length.free_symbols else (),
            group["index"],
        )
        for bound_index in sorted(group["max"]):
            roles[bound_index] = InputRole(
                bound_index, placeholder_nodes[bound_index].name, Role.MAX_SEQLEN, (), group["index"]
            )
        segments = {Role.SEGMENT_LENGTHS: length, Role.PACKED_OFFSETS: length / 2 - 1}.get(role, length - 1)
        attention_groups.append(
            AttentionGroup(group["index"], offsets_index, segments, tuple(sorted(group["max"])), tuple(group["sites"]))
        )

    for index_node, indexed_size in _index_uses(gm):
        indexed = simplify(indexed_size)
        sources, _ = _source_input(index_node, placeholders, parameters)
        for source in sources:
            index = placeholders[source]
            if index in roles or example_value(source).dtype.is_floating_point:
                continue
            role = Role.GATHER_INDEX if indexed.free_symbols else Role.TABLE_INDEX
            dims = tuple(d for d, size in enumerate(example_value(source).shape) if not isinstance(size, int))
            if role is Role.GATHER_INDEX and example_value(source).dim() != 1:
                raise ValueError(
                    f"gather index {source.name!r} has shape {tuple(example_value(source).shape)}: "
                    "vgraph pads 1-D permutation indices only; flatten it before indexing"
                )
            roles[index] = InputRole(index, source.name, role, dims, indexed=indexed if dims else None)

    input_shapes = []
    bindings: dict[sympy.Symbol, tuple[sympy.Symbol, int, int | None]] = {}
    for index, node in enumerate(placeholder_nodes):
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            input_shapes.append(None)
            expr = simplify(value)
            if isinstance(expr, sympy.Symbol):
                bindings.setdefault(expr, (expr, index, None))
            roles.setdefault(index, InputRole(index, node.name, Role.SIZE))
            continue
        if not isinstance(value, torch.Tensor):
            input_shapes.append(None)
            roles.setdefault(index, InputRole(index, node.name, Role.STATIC))
            continue
        shape = tuple(simplify(size) for size in value.shape)
        input_shapes.append(shape)
        symbolic = tuple(d for d, size in enumerate(shape) if size.free_symbols)
        for dim, size in enumerate(shape):
            if isinstance(size, sympy.Symbol):
                bindings.setdefault(size, (size, index, dim))
        if index in parameters:
            role = Role.PARAMETER
        elif symbolic:
            role = Role.TOKENS
        else:
            role = Role.STATIC
        roles.setdefault(index, InputRole(index, node.name, role, symbolic))

    outputs = []
    for value in (example_value(arg) if isinstance(arg, torch.fx.Node) else arg for arg in _output_args(gm)):
        if isinstance(value, torch.Tensor):
            outputs.append(tuple(simplify(size) for size in value.shape))
        elif isinstance(value, torch.SymInt):
            outputs.append(simplify(value))
        else:
            outputs.append(None)

    spec = VarlenSpec(
        inputs=tuple(roles[index] for index in range(len(placeholder_nodes))),
        sites=tuple(sites),
        groups=tuple(sorted(attention_groups, key=lambda group: group.index)),
        token_rows=token_rows,
        token_symbol=token_symbol,
        bindings=tuple(bindings.values()),
        input_shapes=tuple(input_shapes),
        outputs=tuple(outputs),
        features={symbol: int(value) for symbol, value in features.items()},
    )
    ctx.spec = spec
    log.info("discovered %d varlen sites in %d attention groups", len(sites), len(attention_groups))
    log.debug("varlen spec:\n%s", spec.format())
    return gm


def _feature_sizes(placeholder_nodes, parameters, simplify, shape_env) -> dict[sympy.Symbol, sympy.Integer]:
    """Sizes that ``dynamic=True`` made symbolic in the trailing dims of packed inputs (feature widths), at their
    traced values: packed inputs vary in dim 0 only. Bounds later pin them (a call must match them)."""
    leading, trailing = set(), set()
    for index, node in enumerate(placeholder_nodes):
        value = example_value(node)
        if index in parameters or not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            (trailing if dim else leading).update(simplify(size).free_symbols)
    hints = traced_values(shape_env)
    return {symbol: sympy.Integer(int(hints[symbol])) for symbol in trailing - leading if symbol in hints}


def _output_args(gm: torch.fx.GraphModule):
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0]
    return values if isinstance(values, (tuple, list)) else (values,)
