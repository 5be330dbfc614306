"""``pad_varlen`` and ``specialize`` on the one-block PackedViT: graphs before/after, op counts, numerics."""

import copy
import dataclasses

import torch
from expecttest import assert_expected_inline

from tests.helpers import graph_str, op_count
from vgraph_compile.models.packed_vit import pack_images
from vgraph_compile.ops import VARLEN_ATTENTION
from vgraph_compile.passes import pad_varlen, pass_manager, specialize
from vgraph_compile.passes.spec import Role
from vgraph_compile.runtime import padding


def _site(gm):
    return next(node for node in gm.graph.nodes if node.target is VARLEN_ATTENTION.default)


def test_pad_varlen_bakes_the_bound_and_the_backend(tiny):
    """max_seqlen becomes the bucket constant and backend the configured kernel; nothing else changes."""
    _, gm, ctx = tiny
    pass_manager.analyze(gm, ctx)
    assert str(_site(gm).args[3:]) == "(l_cu_seqlens_, l_max_seqlen_)"
    rewritten = pass_manager.apply_pass(
        "pad_varlen", pad_varlen.run, copy.deepcopy(gm), dataclasses.replace(ctx, bucket=ctx.buckets[1])
    )
    assert_expected_inline(
        str(_site(rewritten).format_node()),
        """%attended : [num_users=1] = call_function[target=torch.ops.vgraph.varlen_attention.default](args = (%q, %k, %v, %l_cu_seqlens_, 64), kwargs = {backend: sdpa})""",
    )
    assert op_count(rewritten, VARLEN_ATTENTION.default) == op_count(gm, VARLEN_ATTENTION.default) == 1
    assert len(list(rewritten.graph.nodes)) == len(list(gm.graph.nodes))


def test_specialize_leaves_a_static_graph_with_no_inputs(tiny):
    """Parameters become get_attr of the same tensors, inputs persistent buffers, sizes constants."""
    model, gm, ctx = tiny
    pass_manager.analyze(gm, ctx)
    static = pass_manager.build_bucket_graph(gm, ctx, ctx.buckets[0])
    assert not list(static.graph.find_nodes(op="placeholder"))
    assert static.state_0 is model.embed.weight
    assert_expected_inline(
        graph_str(static),
        """\
class GraphModule(torch.nn.Module):
    def forward(self):
        state_0: "f32[16, 12]" = self.state_0
        state_1: "f32[16]" = self.state_1
        input_3: "f32[16, 12]" = self.input_3

        state_4: "f32[16]" = self.state_4
        state_5: "f32[16]" = self.state_5
        state_6: "f32[48, 16]" = self.state_6
        state_7: "f32[48]" = self.state_7

        input_9: "i32[5]" = self.input_9

        state_11: "f32[16, 16]" = self.state_11
        state_12: "f32[16]" = self.state_12

        state_13: "f32[16]" = self.state_13
        state_14: "f32[16]" = self.state_14
        state_15: "f32[64, 16]" = self.state_15
        state_16: "f32[64]" = self.state_16
        state_17: "f32[16, 64]" = self.state_17
        state_18: "f32[16]" = self.state_18

        state_19: "f32[16]" = self.state_19
        state_20: "f32[16]" = self.state_20

        state_21: "f32[8, 16]" = self.state_21
        state_22: "f32[8]" = self.state_22

        x: "f32[16, 16]" = torch._C._nn.linear(input_3, state_0, state_1);  input_3 = state_0 = state_1 = None

        layer_norm: "f32[16, 16]" = torch.nn.functional.layer_norm(x, (16,), state_4, state_5, 1e-05);  state_4 = state_5 = None
        linear_1: "f32[16, 48]" = torch._C._nn.linear(layer_norm, state_6, state_7);  layer_norm = state_6 = state_7 = None
        view: "f32[16, 3, 2, 8]" = linear_1.view(16, 3, 2, -1);  linear_1 = None
        unbind = view.unbind(1);  view = None
        q: "f32[16, 2, 8]" = unbind[0]
        k: "f32[16, 2, 8]" = unbind[1]
        v: "f32[16, 2, 8]" = unbind[2];  unbind = None

        attended: "f32[16, 2, 8]" = torch.ops.vgraph.varlen_attention.default(q, k, v, input_9, 16, backend = 'sdpa');  q = k = v = input_9 = None

        reshape: "f32[16, 16]" = attended.reshape(16, -1);  attended = None
        linear_2: "f32[16, 16]" = torch._C._nn.linear(reshape, state_11, state_12);  reshape = state_11 = state_12 = None
        x_1: "f32[16, 16]" = x + linear_2;  x = linear_2 = None

        layer_norm_1: "f32[16, 16]" = torch.nn.functional.layer_norm(x_1, (16,), state_13, state_14, 1e-05);  state_13 = state_14 = None
        linear_3: "f32[16, 64]" = torch._C._nn.linear(layer_norm_1, state_15, state_16);  layer_norm_1 = state_15 = state_16 = None
        gelu: "f32[16, 64]" = torch._C._nn.gelu(linear_3);  linear_3 = None
        linear_4: "f32[16, 16]" = torch._C._nn.linear(gelu, state_17, state_18);  gelu = state_17 = state_18 = None
        x_2: "f32[16, 16]" = x_1 + linear_4;  x_1 = linear_4 = None

        x_3: "f32[16, 16]" = torch.nn.functional.layer_norm(x_2, (16,), state_19, state_20, 1e-05);  x_2 = state_19 = state_20 = None

        reshape_1: "f32[16, 16]" = x_3.reshape(-1, 16);  x_3 = None
        linear_5: "f32[16, 8]" = torch._C._nn.linear(reshape_1, state_21, state_22);  reshape_1 = state_21 = state_22 = None
        return (linear_5,)
""",
    )

    patches, cu, max_seqlen = pack_images([5, 7], 12)
    for role in ctx.spec.inputs:
        if role.role in padding.RULES:
            buffer = getattr(static, specialize.buffer_name(role.index))
            padding.fill(role.role, buffer, (patches, cu)[role.role is Role.SEGMENT_OFFSETS])
    with torch.no_grad():
        (out,) = static()
        torch.testing.assert_close(out[:12], model(patches, cu, max_seqlen), rtol=1e-5, atol=1e-5)
