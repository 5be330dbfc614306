"""``record_block_program``: the block stack's program learned from one eager call."""

import torch
from torch import nn

from vgraph_compile.hf.blocks.block_program import record_block_program


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, hidden, scale, shift):
        return self.linear(hidden) * scale + shift


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, hidden, scale, shift):
        for block in self.blocks:
            hidden = block(hidden, scale, shift)
        return hidden


def test_ints_equal_on_the_recorded_call_stay_separate_inputs():
    """``scale`` and ``shift`` are both 16 on the recorded call: each stays an input of its own (merged, a later
    call where they differ would leave the program and run stock); the hidden states are threaded."""
    recorded = record_block_program(_Stack(), (torch.randn(3, 4), 16, 16), {})
    (segment,) = recorded.program.segments
    ints = [leaf.index for call in segment.calls for leaf in call.leaves if leaf.source == "input"]
    assert len(ints) == len(set(ints)) == 4
    assert all(call.leaves[0].source == "threaded" for call in segment.calls)
    assert recorded.segment_inputs[0][1] == (16, 16, 16, 16)
