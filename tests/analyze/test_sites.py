"""Varlen-attention sites: a node is a site iff it calls a listed op (packet or overload), and its arguments are
read by role, whatever op it is."""

import operator

import torch
import torch.fx

import vgraph_compile.kernels.ops  # noqa: F401  (registers the vgraph ops)
from vgraph_compile.analyze.sites import VARLEN_OPS, known_ops, varlen_sites


def _graph(*targets) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """One call of each target on placeholders (q, cu_seqlens, max_seqlen), in order."""
    graph = torch.fx.Graph()
    q, cu, max_seqlen = graph.placeholder("q"), graph.placeholder("cu"), graph.placeholder("max_seqlen")
    calls = [graph.call_function(target, (q, q, q, cu, max_seqlen)) for target in targets]
    graph.output(calls[-1])
    return torch.fx.GraphModule(torch.nn.Module(), graph), calls


def test_sites_are_the_listed_ops_calls_in_graph_order():
    varlen = torch.ops.vgraph.varlen_attention
    gm, calls = _graph(varlen.default, operator.add, varlen)
    sites = list(varlen_sites(gm))
    assert [site.node for site in sites] == [calls[0], calls[2]]
    assert {site.op.name for site in sites} == {"vgraph::varlen_attention"}


def test_arguments_are_read_by_their_role_in_the_ops_schema():
    gm, (call,) = _graph(torch.ops.vgraph.varlen_attention.default)
    (site,) = varlen_sites(gm)
    assert site.argument(site.op.q).name == "q"
    assert [site.argument(name).name for name in site.op.cu_seqlens] == ["cu"]
    assert [site.argument(name).name for name in site.op.max_seqlen] == ["max_seqlen"]
    assert site.argument(site.op.backend) == "default"  # not passed: the schema's default


def test_every_registered_op_names_arguments_its_schema_has():
    """A renamed argument in an op's schema would make its sites unreadable: every op registered in this process
    (vgraph's own always; torch's varlen op on torch >= 2.10; flash_attn when installed) is checked."""
    registered = 0
    for name, op in VARLEN_OPS.items():
        namespace, op_name = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op_name, None)
        if packet is None:
            continue
        registered += 1
        arguments = {argument.name for argument in packet.default._schema.arguments}
        names = [op.q, *op.cu_seqlens, *op.max_seqlen] + ([op.backend] if op.backend else [])
        assert set(names) <= arguments, name
    assert registered >= 2
    assert set(known_ops().split(", ")) == set(VARLEN_OPS)
