"""``fold_scalars``: a module's float attribute that plain ``torch.compile(dynamic=True)`` passes as a 0-d input and
reads with ``.item()`` becomes its traced value; a call with another value is never served with the old one."""

import copy

import torch
from expecttest import assert_expected_inline

import vgraph_compile
from tests.helpers import trace
from vgraph_compile.config import VGraphConfig
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.rewrite import fold_scalars
from vgraph_compile.analyze import analyze
from vgraph_compile.fx_utils import apply_pass
from vgraph_compile.spec import user_name


def _first_layer_norm(gm):
    """The block's first ``layer_norm`` call, its inputs in the user's names."""
    node = next(node for node in gm.graph.nodes if node.target is torch.nn.functional.layer_norm)
    args = [user_name(arg.name) if isinstance(arg, torch.fx.Node) else repr(arg) for arg in node.args]
    return f"layer_norm({', '.join(args)})"


def test_item_of_a_scalar_input_becomes_its_traced_value():
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    config = VGraphConfig(token_budgets=(64,), max_segments=4)
    gm, ctx = trace(model, *pack_images([20, 7], 12), config=config, plain=True)
    analyze(gm, ctx)
    items = sum(node.op == "call_method" and node.target == "item" for node in gm.graph.nodes)
    assert items == 3  # the block's two norms and the final norm
    assert_expected_inline(
        _first_layer_norm(gm),
        """layer_norm(x, (16,), self.blocks.0.norm1.weight, self.blocks.0.norm1.bias, item)""",
    )
    folded = apply_pass("fold_scalars", fold_scalars.run, copy.deepcopy(gm), ctx)
    assert not any(node.op == "call_method" and node.target == "item" for node in folded.graph.nodes)
    assert_expected_inline(
        _first_layer_norm(folded),
        """layer_norm(x, (16,), self.blocks.0.norm1.weight, self.blocks.0.norm1.bias, 1e-05)""",
    )
    assert sorted(fold_scalars.folded(gm, ctx).values()) == [1e-05] * 3


def test_a_changed_scalar_is_never_served_with_the_folded_value():
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    torch._dynamo.reset()
    options = {"token_budgets": [32, 64], "max_segments": 4, "compiler": "eager"}
    compiled = torch.compile(model, backend="vgraph", dynamic=True, options=options)
    inputs = pack_images([20, 7], 12)
    with torch.inference_mode():  # dynamo passes the norms' eps as 0-d inputs read with .item()
        compiled(*inputs)
        runtime = vgraph_compile.runtimes()[-1]
        assert sorted(runtime.encoder.folded.values()) == [1e-05] * 3
        before = compiled(*inputs)
        model.norm.eps = 0.5  # served eagerly by this runtime, or retraced by dynamo: never with the old constant
        after = compiled(*inputs)
    torch.testing.assert_close(after, model(*inputs), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
