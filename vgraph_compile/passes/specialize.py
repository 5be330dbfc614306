"""Rewrite: a static graph for one bucket, with no inputs at all.

Invariant: after this pass the graph has no placeholders and no symbolic value. Parameters and module state
become ``get_attr`` of the very same tensors (never copied); every other tensor input becomes a ``get_attr`` of a
persistent buffer of the bucket's static shape, registered as ``input_<i>``, which the runtime fills before each
run; int inputs and every symbolic scalar node (sizes, ``.item()`` of a traced constant) are folded to numbers.
Inductor then sees only fixed-address tensors: its CUDA graphs copy nothing on replay.

Before/After (budget 64)::

    def forward(self, s77, L_x_, L_w_, s42, L_cu_, ...):      def forward(self):
        view = L_x_.view(s77, 4, -1)                              input_1 = self.input_1
                                                                  view = input_1.view(64, 4, -1)
"""

from __future__ import annotations

import logging

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from vgraph_compile.passes.fx_utils import example_value
from vgraph_compile.passes.spec import PassContext, Role

__all__ = ["run", "buffer_name"]

log = logging.getLogger(__name__)


def buffer_name(index: int) -> str:
    """Attribute name of the persistent buffer for graph input ``index``."""
    return f"input_{index}"


def _fold(expr: sympy.Expr, ctx: PassContext, kind: type) -> int | float | bool:
    value = sympy.sympify(ctx.shape_env.replace(expr)).xreplace(
        {symbol: sympy.Integer(v) for symbol, v in ctx.bucket.values.items()}
    )
    if not value.is_number and value not in (sympy.true, sympy.false):
        raise ValueError(f"cannot fold {expr} to a constant for budget {ctx.bucket.budget}: left {value}")
    return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[kind](value)


def _refresh_shapes(gm: torch.fx.GraphModule) -> None:
    """Replace the trace's symbolic fake values with the static ones of this bucket."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        FakeTensorProp(gm, mode).propagate()
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    spec = ctx.spec
    sizes = {symbol: sympy.Integer(value) for symbol, value in ctx.bucket.values.items()}
    for index, node in enumerate(list(graph.find_nodes(op="placeholder"))):
        role = spec.inputs[index]
        value = ctx.example_inputs[index]
        if role.role is Role.PARAMETER:
            name = f"state_{index}"
            if isinstance(value, torch.nn.Parameter):
                gm.register_parameter(name, value)
            else:
                gm.register_buffer(name, value)
        elif isinstance(value, torch.Tensor):
            name = buffer_name(index)
            shape = [int(size.xreplace(sizes)) for size in spec.input_shapes[index]]
            gm.register_buffer(name, torch.zeros(shape, dtype=value.dtype, device=value.device))
        else:
            node.replace_all_uses_with(_fold(example_value(node).node.expr, ctx, torch.SymInt))
            graph.erase_node(node)
            continue
        with graph.inserting_before(node):
            attribute = graph.get_attr(name)
        attribute.meta.update(node.meta)
        node.replace_all_uses_with(attribute)
        graph.erase_node(node)

    folded = 0
    for node in list(graph.nodes):
        value = example_value(node)
        if node.op != "output" and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            node.replace_all_uses_with(_fold(value.node.expr, ctx, type(value)))
            graph.erase_node(node)
            folded += 1
    graph.eliminate_dead_code()
    _refresh_shapes(gm)
    log.debug("budget %d: static graph, %d symbolic nodes folded", ctx.bucket.budget, folded)
    return gm
