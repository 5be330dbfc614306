"""Analysis: find the varlen-attention sites and give every graph input a role, from data flow alone.

Invariant: never mutates the graph; stores a ``VarlenSpec`` in ``ctx.spec``.

Steps, each a function with a typed result (``run`` chains them):
1. ``find_sites``: every call of an op in ``sites.VARLEN_OPS``; its cu_seqlens followed back to the one graph
   input it comes from (a path through ``cumsum`` means the input holds lengths, otherwise offsets), its
   max_seqlen back to the int inputs it comes from.
2. ``attention_groups``: sites sharing one offsets input form a group; the group's offsets and max_seqlen
   inputs get their roles (SEGMENT_OFFSETS / SEGMENT_LENGTHS / PACKED_OFFSETS, MAX_SEQLEN).
3. ``index_roles``: integer inputs reaching an index that writes rows (``index_copy``, ``index_put``,
   ``scatter``, ``x[i] = ...``) are SCATTER_INDEX; those reaching a read are GATHER_INDEX when the indexed dim
   is symbolic, else TABLE_INDEX.
4. ``bindings``: where each size symbol is read per call; every other input's role (TOKENS for tensors with a
   symbolic dim, PARAMETER for module state, STATIC, SIZE for ints).
5. ``relations`` (computed before 2, whose sizes go through them): sizes the graph ties together (a reshape's
   requested size equals the size it produces, an ``Eq`` guard), solved for one symbol each; e.g. Qwen2.5-VL's
   window permutation gives tokens = 4 n.
6. ``check_token_rows``: the first site's packed row count, with the relations applied; it must be a constant plus
   positive multiples of sizes (``patches + images`` with a CLS row per image), which the budgets bound.
7. ``outputs``: each output's shape or value expression.
Refused with a ValueError in the user's names: no site; a data-dependent value (``.item()``/``.tolist()``
would sync the host inside a graph); cu_seqlens not a 1-D int32 input; a non-integer max_seqlen; tokens of
another floating dtype than the parameters they meet; a row count no relation reduces to a sum of sizes (the
message gives the ``torch._check`` to add). A trace whose token count is a constant raises
``StaticTokensError`` (the backend runs it eagerly and says how to get a dynamic trace).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Callable, Iterator

import sympy
import torch
import torch.fx
from torch._dynamo import source as dynamo_source
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import ancestors, callable_name, example_value
from vgraph_compile.symbolic import substitute, traced_values
from vgraph_compile.analyze.sites import Site, known_ops, varlen_sites
from vgraph_compile.spec import (
    AttentionGroup,
    Binding,
    InputRole,
    PassContext,
    Role,
    StaticTokensError,
    VarlenSite,
    VarlenSpec,
    user_name,
)

__all__ = [
    "run",
    "StaticTokensError",
    "graph_inputs",
    "find_sites",
    "attention_groups",
    "index_roles",
    "bindings",
    "relations",
    "check_token_rows",
]

log = logging.getLogger(__name__)

Simplify = Callable[[object], sympy.Expr]


@dataclass(frozen=True)
class Inputs:
    """The graph's inputs: placeholders in order, and which of them are module state."""

    nodes: tuple[torch.fx.Node, ...]
    parameters: frozenset[int]

    def index(self, node: torch.fx.Node) -> int | None:
        """Position of ``node`` among the inputs; None for any other node."""
        return self.nodes.index(node) if node.op == "placeholder" else None

    def name(self, index: int) -> str:
        return user_name(self.nodes[index].name)


@dataclass(frozen=True)
class FoundSite:
    """A varlen site and the inputs its offsets and max_seqlen come from."""

    site: Site
    rows: sympy.Expr
    offsets_input: int
    lengths: bool
    """The offsets input holds segment lengths (the graph takes their cumsum)."""
    max_seqlen_inputs: frozenset[int]
    direct: bool
    """The site reads the offsets input itself, not offsets computed from it."""


def _expr(value) -> sympy.Expr:
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value.node.expr
    return sympy.sympify(value)


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


def graph_inputs(gm: torch.fx.GraphModule, ctx: PassContext) -> Inputs:
    nodes = tuple(gm.graph.find_nodes(op="placeholder"))
    parameters = frozenset(
        index
        for index, node in enumerate(nodes)
        if isinstance(ctx.example_inputs[index], torch.nn.Parameter)
        or _module_state(getattr(node, "_dynamo_source", None))
    )
    return Inputs(nodes, parameters)


def _source_inputs(start: torch.fx.Node, inputs: Inputs) -> tuple[list[int], bool]:
    """The non-parameter tensor inputs ``start`` is computed from, and whether the path has a cumsum."""
    sources, has_cumsum = [], False
    for node in ancestors(start):
        index = inputs.index(node)
        if index is not None:
            if index not in inputs.parameters and isinstance(example_value(node), torch.Tensor):
                sources.append(index)
        elif node.op in ("call_function", "call_method"):
            has_cumsum |= callable_name(node) == "cumsum"
    return sorted(sources), has_cumsum


def _offsets_input(site: Site, argument: str, inputs: Inputs) -> tuple[int, bool]:
    """The input a site's offsets argument comes from, checked to be 1-D integer offsets or lengths."""
    sources, has_cumsum = _source_inputs(site.argument(argument), inputs)
    if len(sources) != 1:
        names = [inputs.name(index) for index in sources]
        raise ValueError(
            f"{argument} of {site.node.format_node()} comes from inputs {names}, not from exactly one input: "
            "pass the int32 cu_seqlens (prefix sums of segment lengths) to the encoder as an input"
        )
    (index,) = sources
    value, name = example_value(inputs.nodes[index]), inputs.name(index)
    if value.dim() != 1:
        raise ValueError(
            f"cu_seqlens input {name!r} is {value.dim()}-D: it must be 1-D [segments + 1], "
            f"the prefix sums of the segment lengths; flatten it (e.g. {name}.reshape(-1))"
        )
    not_integer = value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
    if not_integer or (not has_cumsum and value.dtype != torch.int32):
        raise ValueError(
            f"cu_seqlens input {name!r} is {value.dtype}: varlen kernels read int32 offsets; "
            f"build it with dtype=torch.int32 ({name}.to(torch.int32))"
        )
    return index, has_cumsum


def _max_seqlen_inputs(site: Site, inputs: Inputs) -> frozenset[int]:
    found = set()
    for argument in site.op.max_seqlen:
        bound = site.argument(argument)
        if not isinstance(bound, torch.fx.Node):
            continue
        sources = list(ancestors(bound))
        if any(isinstance(example_value(node), torch.SymFloat) for node in sources):
            names = [inputs.name(index) for index in map(inputs.index, sources) if index is not None]
            raise ValueError(
                f"max_seqlen input {', '.join(map(repr, names))} is a float: it must be a Python int, the length "
                "of the longest segment (pass int(max_seqlen))"
            )
        for node in sources:
            index = inputs.index(node)
            if index is not None and isinstance(example_value(node), torch.SymInt):
                found.add(index)
    return frozenset(found)


def find_sites(gm: torch.fx.GraphModule, inputs: Inputs, simplify: Simplify) -> list[FoundSite]:
    """Step 1: every varlen site, with the inputs its offsets and max_seqlen come from."""
    found = []
    for site in varlen_sites(gm):
        offsets = {
            _offsets_input(site, argument, inputs)
            for argument in site.op.cu_seqlens
            if site.argument(argument) is not None
        }
        if len({index for index, _ in offsets}) != 1:
            raise ValueError(
                f"q and k offsets of {site.node.format_node()} come from different inputs; vgraph needs one"
            )
        rows = simplify(example_value(site.argument(site.op.q)).shape[0])
        index = next(iter(offsets))[0]
        lengths = any(has_cumsum for _, has_cumsum in offsets)
        direct = all(site.argument(argument) in (inputs.nodes[index], None) for argument in site.op.cu_seqlens)
        found.append(FoundSite(site, rows, index, lengths, _max_seqlen_inputs(site, inputs), direct))
        counters.sites_found += 1
    if not found:
        raise ValueError(
            f"no varlen-attention call found in the traced graph (looked for {known_ops()}): route the encoder's "
            "attention through vgraph_compile.varlen_attention(q, k, v, cu_seqlens, max_seqlen)"
        )
    return found


def attention_groups(
    found: list[FoundSite], inputs: Inputs, simplify: Simplify
) -> tuple[tuple[AttentionGroup, ...], dict[int, InputRole]]:
    """Step 2: sites grouped by offsets input, in order of first use; the roles of offsets and max_seqlen inputs."""
    by_input: dict[int, list[FoundSite]] = {}
    for site in found:
        by_input.setdefault(site.offsets_input, []).append(site)
    groups, roles = [], {}
    for group_index, (offsets_index, members) in enumerate(by_input.items()):
        length = simplify(example_value(inputs.nodes[offsets_index]).shape[0])
        if any(member.site.op.packed for member in members):
            role, segments = Role.PACKED_OFFSETS, length / 2 - 1
        elif any(member.lengths for member in members):
            role, segments = Role.SEGMENT_LENGTHS, length
        else:
            role, segments = Role.SEGMENT_OFFSETS, length - 1
        dims = (0,) if length.free_symbols else ()
        roles[offsets_index] = InputRole(offsets_index, inputs.nodes[offsets_index].name, role, dims, group_index)
        maxima = sorted(frozenset().union(*(member.max_seqlen_inputs for member in members)))
        for index in maxima:
            roles[index] = InputRole(index, inputs.nodes[index].name, Role.MAX_SEQLEN, (), group_index)
        sites = tuple(member.site.node.name for member in members)
        ends = {simplify(member.rows) for member in members}
        direct = role is Role.SEGMENT_OFFSETS and all(member.direct for member in members)
        ends_at = ends.pop() if direct and len(ends) == 1 else None
        groups.append(AttentionGroup(group_index, offsets_index, segments, tuple(maxima), sites, ends_at))
    return tuple(groups), roles


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
    """Step 3: SCATTER_INDEX / GATHER_INDEX / TABLE_INDEX roles of integer inputs used as indices (not already
    given a role); an input that both writes and reads is a SCATTER_INDEX (its padding serves both)."""
    roles: dict[int, InputRole] = {}
    for index_node, written_size in _write_uses(gm):
        written = simplify(written_size)
        for index in _source_inputs(index_node, inputs)[0]:
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
        sources, _ = _source_inputs(index_node, inputs)
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


@dataclass(frozen=True)
class InputSizes:
    """Result of ``bindings``."""

    bindings: tuple[Binding, ...]
    """Where each size symbol is read per call (first place it appears)."""
    shapes: tuple[tuple[sympy.Expr, ...] | None, ...]
    """Per input, its shape (None for ints and constants)."""
    roles: dict[int, InputRole]
    """Roles of the inputs no earlier step gave one."""


def bindings(inputs: Inputs, taken: dict[int, InputRole], simplify: Simplify) -> InputSizes:
    """Step 4: where each size symbol is read, every input's shape, and the roles of inputs not yet given one."""
    found: dict[sympy.Symbol, Binding] = {}
    shapes, roles = [], {}
    for index, node in enumerate(inputs.nodes):
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            shapes.append(None)
            expr = simplify(value)
            if isinstance(expr, sympy.Symbol):
                found.setdefault(expr, Binding(expr, index, None))
            roles[index] = InputRole(index, node.name, Role.SIZE)
            continue
        if not isinstance(value, torch.Tensor):
            shapes.append(None)
            roles[index] = InputRole(index, node.name, Role.STATIC)
            continue
        shape = tuple(simplify(size) for size in value.shape)
        shapes.append(shape)
        for dim, size in enumerate(shape):
            if isinstance(size, sympy.Symbol):
                found.setdefault(size, Binding(size, index, dim))
        symbolic = tuple(d for d, size in enumerate(shape) if size.free_symbols)
        role = Role.PARAMETER if index in inputs.parameters else Role.TOKENS if symbolic else Role.STATIC
        roles[index] = InputRole(index, node.name, role, symbolic)
    roles = {index: role for index, role in roles.items() if index not in taken}
    return InputSizes(tuple(found.values()), tuple(shapes), roles)


def _view_equalities(gm: torch.fx.GraphModule, simplify: Simplify) -> Iterator[tuple[sympy.Expr, sympy.Expr]]:
    """(produced size, requested size) of every reshape/view dim the caller gave explicitly."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or callable_name(node) not in ("view", "reshape"):
            continue
        requested = node.args[1:]
        if len(requested) == 1 and isinstance(requested[0], (tuple, list)):
            requested = requested[0]
        produced = example_value(node)
        if not isinstance(produced, torch.Tensor) or len(requested) != produced.dim():
            continue
        for size, want in zip(produced.shape, requested):
            want = example_value(want) if isinstance(want, torch.fx.Node) else want
            if isinstance(want, (int, torch.SymInt)) and not (isinstance(want, int) and want < 0):
                yield simplify(size), simplify(want)


def _integer_polynomial(expr: sympy.Expr) -> bool:
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str)) if expr.free_symbols else None
    except sympy.PolynomialError:
        return False
    return poly is None or all(coefficient.is_Integer for coefficient in poly.coeffs())


def relations(gm: torch.fx.GraphModule, shape_env, simplify: Simplify) -> dict[sympy.Symbol, sympy.Expr]:
    """Step 5: sizes the graph ties to others, each solved for one symbol as an integer polynomial of the rest.

    Sources: a reshape/view's produced dim equals the one the caller asked for; the ShapeEnv's ``Eq`` guards.
    A compound size equal to a constant (``s // (s // 4) == 4``) is used to simplify the others."""
    equalities = [(lhs, rhs) for lhs, rhs in _view_equalities(gm, simplify) if (lhs - rhs).free_symbols]
    for guard in shape_env.guards:
        expr = simplify(guard.expr)
        if isinstance(expr, sympy.Eq):
            equalities.append((expr.lhs, expr.rhs))
    equalities = list(dict.fromkeys(equalities))
    constants: dict[sympy.Expr, sympy.Expr] = {}
    solved: dict[sympy.Symbol, sympy.Expr] = {}

    def reduce(expr: sympy.Expr) -> sympy.Expr:
        for _ in range(8):
            reduced = sympy.sympify(expr).xreplace(constants).xreplace(solved)
            if reduced == expr:
                break
            expr = reduced
        return expr

    changed = True
    while changed:
        changed = False
        for lhs, rhs in equalities:
            lhs, rhs = reduce(lhs), reduce(rhs)
            if not (lhs - rhs).free_symbols or sympy.simplify(lhs - rhs) == 0:
                continue
            for compound, constant in ((lhs, rhs), (rhs, lhs)):
                if constant.is_Integer and not compound.is_Symbol and compound not in constants:
                    constants[compound] = constant
                    changed = True
                    break
            else:
                for symbol in sorted((lhs - rhs).free_symbols, key=str):
                    try:
                        solutions = sympy.solve(sympy.Eq(lhs, rhs), symbol)
                    except (NotImplementedError, TypeError):
                        continue
                    if len(solutions) == 1 and symbol not in solutions[0].free_symbols:
                        if _integer_polynomial(solutions[0]) and solutions[0].free_symbols:
                            solved[symbol] = solutions[0]
                            solved.update({key: reduce(value) for key, value in solved.items()})
                            changed = True
                            break
    return {symbol: reduce(value) for symbol, value in solved.items()}


def _tie_hint(rows: sympy.Expr, spec_names: Callable[[sympy.Symbol], str], hints: dict) -> str:
    """The ``torch._check`` line tying two sizes of ``rows``, with the ratio they had in the traced call."""
    symbols = sorted(rows.free_symbols, key=lambda symbol: -int(hints.get(symbol, 0)))
    if len(symbols) >= 2 and all(symbol in hints for symbol in symbols[:2]):
        big, small = symbols[:2]
        ratio = int(hints[big]) // max(int(hints[small]), 1)
        if ratio * int(hints[small]) == int(hints[big]):
            factor = "" if ratio == 1 else f"{ratio} * "
            return f"torch._check({spec_names(big)} == {factor}{spec_names(small)})"
    names = " and ".join(spec_names(symbol) for symbol in symbols)
    return f"torch._check(...) relating {names}"


def check_token_rows(spec: VarlenSpec, hints: dict) -> None:
    """Step 6: the token rows (first site, relations applied) must be a constant plus positive multiples of
    sizes; refused in the user's names otherwise."""
    rows = spec.token_rows
    if not rows.free_symbols:
        raise StaticTokensError(
            f"the trace fixed the attention's packed row count at {rows}: without dynamic=True, or with "
            "duck sizing (a first call whose token count equals another size) or a first call of one token, "
            "dynamo specializes it. Use vgraph_compile.encoder, which traces with neither."
        )
    poly = None
    try:
        poly = sympy.Poly(rows, *sorted(rows.free_symbols, key=str))
    except sympy.PolynomialError:
        pass
    if (
        poly is None
        or poly.total_degree() != 1
        or any(
            not coefficient.is_Integer or (any(monomial) and coefficient <= 0) for monomial, coefficient in poly.terms()
        )
    ):
        pinned = _pinned_dims(spec)
        if pinned:
            raise StaticTokensError(
                f"the attention's packed row count is {spec.describe_expr(rows)}, not a sum of sizes, because the "
                f"trace fixed {', '.join(pinned)} (dynamo specializes sizes 0 and 1): it serves such calls only. "
                "Use vgraph_compile.encoder, which traces without that specialization."
            )
        raise ValueError(
            f"the attention's packed row count is {spec.describe_expr(rows)}: vgraph bounds a sum of sizes (e.g. "
            "patches + one CLS row per image), and found no relation in the graph that reduces it to one. "
            f"Tie the sizes in the encoder before the attention, e.g. {_tie_hint(rows, spec.describe, hints)}"
        )


def _pinned_dims(spec: VarlenSpec) -> list[str]:
    """Leading dims of non-parameter tensor inputs that the trace fixed at 0 or 1."""
    return [
        f"{spec.describe_input(role.index)}.shape[0] == {shape[0]}"
        for role, shape in zip(spec.inputs, spec.input_shapes)
        if role.role is not Role.PARAMETER and shape and shape[0] in (0, 1)
    ]


def _check_token_dtypes(gm: torch.fx.GraphModule, inputs: Inputs, roles: dict[int, InputRole]) -> None:
    """Tokens must have the floating dtype of the parameters they first meet (a matmul would fail after compile)."""
    parameters = {inputs.nodes[index] for index in inputs.parameters}
    for index, role in roles.items():
        value = example_value(inputs.nodes[index])
        if role.role is not Role.TOKENS or not isinstance(value, torch.Tensor):
            continue
        for user in inputs.nodes[index].users:
            met = [
                example_value(arg)
                for arg in user.all_input_nodes
                if arg in parameters and isinstance(example_value(arg), torch.Tensor) and example_value(arg).dim() > 1
            ]
            for parameter in met:
                if parameter.dtype.is_floating_point and parameter.dtype != value.dtype:
                    name = inputs.name(index)
                    raise ValueError(
                        f"input {name!r} is {value.dtype} but meets parameters of {parameter.dtype} in "
                        f"{user.format_node()}: pass {name}.to({parameter.dtype}) (or cast the encoder)"
                    )


def _outputs(gm: torch.fx.GraphModule, simplify: Simplify) -> tuple:
    """Step 7: per output, its shape (tensors), its value expression (ints), or None."""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    outputs = []
    for arg in values:
        value = example_value(arg) if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.Tensor):
            outputs.append(tuple(simplify(size) for size in value.shape))
        elif isinstance(value, torch.SymInt):
            outputs.append(simplify(value))
        else:
            outputs.append(None)
    return tuple(outputs)


def _feature_sizes(inputs: Inputs, simplify: Simplify, shape_env) -> dict[sympy.Symbol, int]:
    """Sizes that ``dynamic=True`` made symbolic in the trailing dims of packed inputs (feature widths), at their
    traced values: packed inputs vary in dim 0 only. Bounds later pin them (a call must match them)."""
    leading, trailing = set(), set()
    for index, node in enumerate(inputs.nodes):
        value = example_value(node)
        if index in inputs.parameters or not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            (trailing if dim else leading).update(simplify(size).free_symbols)
    hints = traced_values(shape_env)
    return {symbol: int(hints[symbol]) for symbol in trailing - leading if symbol in hints}


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    _check_no_host_sync(gm)
    shape_env = ctx.shape_env

    def simplify(value) -> sympy.Expr:
        return sympy.sympify(shape_env.replace(_expr(value)))

    inputs = graph_inputs(gm, ctx)
    found = find_sites(gm, inputs, simplify)
    features = _feature_sizes(inputs, simplify, shape_env)
    solved = {symbol: expr for symbol, expr in relations(gm, shape_env, simplify).items() if symbol not in features}

    def related(value) -> sympy.Expr:
        """A size with the trace's replacements and the graph's relations applied."""
        return sympy.sympify(simplify(value).xreplace(solved))

    groups, roles = attention_groups(found, inputs, related)
    roles.update(index_roles(gm, inputs, roles, related))
    sizes = bindings(inputs, roles, simplify)
    roles.update(sizes.roles)
    _check_token_dtypes(gm, inputs, roles)
    group_of = {site: group.index for group in groups for site in group.sites}
    spec = VarlenSpec(
        inputs=tuple(roles[index] for index in range(len(inputs.nodes))),
        sites=tuple(
            VarlenSite(f.site.node.name, f.site.op.name, group_of[f.site.node.name], related(f.rows)) for f in found
        ),
        groups=groups,
        token_rows=substitute(related(found[0].rows), features),
        bindings=sizes.bindings,
        input_shapes=sizes.shapes,
        outputs=_outputs(gm, simplify),
        features=features,
        relations=solved,
    )
    check_token_rows(spec, traced_values(shape_env))
    ctx.spec = spec
    log.info("discovered %d varlen sites in %d attention groups", len(found), len(groups))
    log.debug("varlen spec:\n%s", spec.format())
    return gm
