"""Analysis: find the varlen-attention sites and give every graph input a role, from data flow alone.

Invariant: never mutates the graph; stores a ``VarlenSpec`` in ``ctx.spec``.

Steps (``run`` chains them; each lives in its own module and returns a typed result):
1. ``refusals.check_no_host_sync``: no data-dependent value inside the graph.
2. ``inputs``: the graph's inputs, which are module state, and the trailing feature sizes.
3. ``groups.find_sites``: every varlen site, its offsets and max_seqlen followed back to graph inputs.
4. ``relations``: sizes the graph ties together, solved for one symbol each; the sizes of steps 5-6 go through
   them (Qwen2.5-VL's window permutation gives tokens = 4 n).
5. ``groups.attention_groups``: sites sharing one offsets input form a group; its offsets and max_seqlen roles.
6. ``roles.index_roles``, then ``roles.other_roles``: indices that write or read rows; every other input.
7. ``inputs.input_sizes``: where each size symbol is read per call; ``refusals.check_token_dtypes``.
8. ``inputs.output_shapes``: each output's shape or value expression.
9. ``refusals.check_token_rows``: the first site's packed row count must be a constant plus positive multiples of
   sizes (``patches + images`` with a CLS row per image), which the budgets bound.

Before/After: the graph is unchanged; ``ctx.spec.format()`` of the tiny ``PackedViT`` reads::

    tokens: patches.shape[0]
    group 0: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended']
    input patches: tokens dims=[0]
    input cu_seqlens: segment_offsets dims=[0] group=0
    input max_seqlen: max_seqlen group=0
"""

from __future__ import annotations

import logging

import sympy
import torch
import torch.fx

from vgraph_compile.analyze import groups, inputs, refusals, relations, roles
from vgraph_compile.spec import PassContext, VarlenSite, VarlenSpec
from vgraph_compile.symbolic import substitute, traced_values

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    refusals.check_no_host_sync(gm)
    shape_env = ctx.shape_env
    simplify = inputs.simplifier(shape_env)
    graph_inputs = inputs.graph_inputs(gm, ctx)
    found = groups.find_sites(gm, graph_inputs, simplify)
    features = inputs.feature_sizes(graph_inputs, simplify, shape_env)
    solved = {
        symbol: expr for symbol, expr in relations.relations(gm, shape_env, simplify).items() if symbol not in features
    }

    def related(value) -> sympy.Expr:
        """A size with the trace's replacements and the graph's relations applied."""
        return sympy.sympify(simplify(value).xreplace(solved))

    attention_groups, input_roles = groups.attention_groups(found, graph_inputs, related)
    input_roles.update(roles.index_roles(gm, graph_inputs, input_roles, related))
    input_roles.update(roles.other_roles(graph_inputs, input_roles, simplify))
    sizes = inputs.input_sizes(graph_inputs, simplify)
    refusals.check_token_dtypes(gm, graph_inputs, input_roles)
    group_of = {site: group.index for group in attention_groups for site in group.sites}
    spec = VarlenSpec(
        inputs=tuple(input_roles[index] for index in range(len(graph_inputs.nodes))),
        sites=tuple(
            VarlenSite(f.site.node.name, group_of[f.site.node.name], related(f.rows)) for f in found
        ),
        groups=attention_groups,
        token_rows=substitute(related(found[0].rows), features),
        bindings=sizes.bindings,
        input_shapes=sizes.shapes,
        outputs=inputs.output_shapes(gm, simplify),
        features=features,
        relations=solved,
    )
    refusals.check_token_rows(spec, traced_values(shape_env))
    ctx.spec = spec
    log.info("discovered %d varlen sites in %d attention groups", len(found), len(attention_groups))
    log.debug("varlen spec:\n%s", spec.format())
    return gm
