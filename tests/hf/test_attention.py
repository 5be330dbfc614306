"""The attention function the towers are routed through: transformers' layout in, per-segment attention out, the
refusals that say why, and the tower's own attention setting back after the block."""

import pytest
import torch
from transformers import AttentionInterface, PretrainedConfig

from tests.helpers import segment_reference
from vgraph_compile.hf.attention import ATTENTION_NAME, routed_attention, vgraph_flash_attention
from vgraph_compile.kernels.segments import cu_seqlens


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig(attn_implementation="sdpa")


def test_the_function_takes_transformers_layout_and_attends_per_segment():
    """``[1, heads, tokens, head_dim]`` in, ``[1, tokens, heads, head_dim]`` out, equal to per-segment attention."""
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    cu = cu_seqlens([4, 0, 5])
    out, weights = vgraph_flash_attention(Tower(), q, k, v, None, 0.5, cu_seq_lens_q=cu, max_length_q=5)
    assert weights is None and out.shape == (1, 9, 2, 8)
    packed = [tensor[0].transpose(0, 1) for tensor in (q, k, v)]
    torch.testing.assert_close(out[0], segment_reference(*packed, cu, scale=0.5))


def test_a_call_without_cu_seqlens_or_with_dropout_is_refused_with_the_reason():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="Tower called the vgraph attention without cu_seqlens/max_seqlen"):
        vgraph_flash_attention(Tower(), q, q, q, None)
    with pytest.raises(ValueError, match=r"inference-only: put the tower in eval\(\) mode"):
        vgraph_flash_attention(Tower(), q, q, q, None, dropout=0.1, cu_seq_lens_q=cu_seqlens([4]), max_length_q=4)


def test_the_tower_attends_through_vgraph_inside_the_block_only():
    """The name is registered with transformers and contains "flash" (the towers' packed branch); the tower's own
    setting is back after the block, also when the block raises."""
    tower = Tower()
    with routed_attention(tower):
        assert tower.config._attn_implementation == ATTENTION_NAME and "flash" in ATTENTION_NAME
        assert AttentionInterface()[ATTENTION_NAME] is vgraph_flash_attention
    assert tower.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="in the block"), routed_attention(tower):
        raise RuntimeError("in the block")
    assert tower.config._attn_implementation == "sdpa"


@pytest.mark.gpu
def test_offsets_the_tower_computed_on_the_host_are_read_where_q_is():
    """A tower handed grid_thw on the host computes its cu_seqlens there: the routed attention still runs on q's
    device, equal to per-segment attention."""
    q, k, v = (torch.randn(1, 2, 9, 8, device="cuda") for _ in range(3))
    cu = cu_seqlens([4, 5])
    out, _ = vgraph_flash_attention(Tower(), q, k, v, None, 0.5, cu_seq_lens_q=cu, max_length_q=5)
    packed = [tensor[0].transpose(0, 1).double().cpu() for tensor in (q, k, v)]
    torch.testing.assert_close(out[0].double().cpu(), segment_reference(*packed, cu, scale=0.5), rtol=1e-4, atol=1e-4)
