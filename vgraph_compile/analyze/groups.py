"""The attention groups: every varlen site, the offsets and max_seqlen inputs it reads, and sites grouped by
the offsets input they share.

Invariant: a site's cu_seqlens is followed back to exactly one graph input (a path through ``cumsum`` means that
input holds lengths, otherwise offsets) and its max_seqlen back to the int inputs it comes from; refused in the
user's names otherwise (not one input, not 1-D, not int32, a float max_seqlen, no site at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx

from vgraph_compile.analyze.inputs import Inputs, Simplify, source_inputs
from vgraph_compile.analyze.sites import Site, known_ops, varlen_sites
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import ancestors, example_value
from vgraph_compile.spec import AttentionGroup, InputRole, Role

__all__ = ["FoundSite", "find_sites", "attention_groups"]


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


def _offsets_input(site: Site, argument: str, inputs: Inputs) -> tuple[int, bool]:
    """The input a site's offsets argument comes from, checked to be 1-D integer offsets or lengths."""
    sources, has_cumsum = source_inputs(site.argument(argument), inputs)
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
    """every varlen site, with the inputs its offsets and max_seqlen come from."""
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
    """sites grouped by offsets input, in order of first use; the roles of offsets and max_seqlen inputs."""
    by_input: dict[int, list[FoundSite]] = {}
    for site in found:
        by_input.setdefault(site.offsets_input, []).append(site)
    groups, roles = [], {}
    for group_index, (offsets_index, members) in enumerate(by_input.items()):
        length = simplify(example_value(inputs.nodes[offsets_index]).shape[0])
        if any(member.site.op.qkv_offsets for member in members):
            role, segments = Role.QKV_OFFSETS, length / 2 - 1
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
