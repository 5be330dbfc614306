"""``drop_true_masks``: an attention mask that is all True by construction (Idefics3's SigLIP called without a
``patch_attention_mask``) leaves its SDPA call; a mask that reads an input, or one not proven all True, stays."""

import copy

import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.fx_utils import apply_pass, callable_name
from vgraph_compile.rewrite import drop_true_masks
from vgraph_compile.spec import user_name

transformers = pytest.importorskip("transformers", minversion="5.23")


def _idefics3_tower() -> torch.nn.Module:
    config = transformers.Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Idefics3VisionTransformer(config).eval()


def _attention_calls(gm) -> str:
    """Each SDPA call's mask argument, in the user's names."""
    calls = [node for node in gm.graph.nodes if callable_name(node) == "scaled_dot_product_attention"]
    masks = [node.kwargs.get("attn_mask") for node in calls]
    return "\n".join(f"sdpa(attn_mask={user_name(mask.name) if mask is not None else None})" for mask in masks)


def test_the_towers_own_all_true_mask_is_dropped_and_the_output_is_unchanged():
    tower = _idefics3_tower()
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        gm, ctx = trace(lambda x: tower(x).last_hidden_state, pixels)
        assert_expected_inline(_attention_calls(gm), """\
sdpa(attn_mask=attention_mask_1)
sdpa(attn_mask=attention_mask_1)""")
        dropped = apply_pass("drop_true_masks", drop_true_masks.run, copy.deepcopy(gm), ctx)
        assert_expected_inline(_attention_calls(dropped), """\
sdpa(attn_mask=None)
sdpa(attn_mask=None)""")
        for tiles in (1, 2, 5):
            x = torch.randn(tiles, 3, 32, 32)
            (got,), want = dropped(x.shape[0], x, *ctx.example_inputs[2:]), tower(x).last_hidden_state
            assert ((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_a_mask_read_from_an_input_is_kept():
    tower = _idefics3_tower()
    pixels, mask = torch.randn(3, 3, 32, 32), torch.ones(3, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        gm, _ = trace(lambda x, m: tower(x, patch_attention_mask=m).last_hidden_state, pixels, mask)
    assert gm.graph.find_nodes(op="placeholder") and drop_true_masks.true_masks(gm) == []


class _RangeMasked(torch.nn.Module):
    """Attention under ``arange(L) >= start``: all True only for start 0."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def forward(self, q):
        keep = torch.arange(q.shape[2], device=q.device) >= self.start
        mask = torch.ones(q.shape[0], 1, 1, q.shape[2], dtype=torch.bool) & keep
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize(("start", "dropped"), [(0, 1), (1, 0)])
def test_only_a_mask_proven_all_true_is_dropped(start, dropped):
    q = torch.randn(3, 2, 8, 4)
    gm, _ = trace(_RangeMasked(start), q)
    assert len(drop_true_masks.true_masks(gm)) == dropped
