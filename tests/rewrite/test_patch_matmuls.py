"""``patch_matmuls``: a convolution whose stride equals its kernel runs as one matmul over its patches, with the
convolution's values, shape and layout, whatever the batch size; any other convolution is left as it is."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import op_count, trace
from vgraph_compile.fx_utils import apply_pass, callable_name
from vgraph_compile.rewrite import patch_matmuls


def _convolutions(gm) -> int:
    return sum(callable_name(node).startswith("conv") for node in gm.graph.nodes)


def _rewritten(module, example):
    """The module's trace after the pass, as a function of a new input, and its convolutions before the pass."""
    with torch.no_grad():
        gm, ctx = trace(module, example, static_widths=True)
    before = _convolutions(gm)
    gm = apply_pass("patch_matmuls", patch_matmuls.run, gm, ctx)

    def call(x):
        inputs = [
            x.shape[0] if not isinstance(value, torch.Tensor) else value if isinstance(value, torch.nn.Parameter) else x
            for value in ctx.example_inputs
        ]
        return gm(*inputs)[0]

    return gm, call, before


class _PatchEmbed(torch.nn.Module):
    """Qwen2-VL's patch embedding: each row of the input is one patch, viewed as ``[C, T, P, P]``."""

    def __init__(self, channels=3, temporal=2, patch=4, width=8, bias=False):
        super().__init__()
        self.shape = (channels, temporal, patch, patch)
        self.proj = torch.nn.Conv3d(channels, width, self.shape[1:], stride=self.shape[1:], bias=bias)

    def forward(self, rows):
        return self.proj(rows.view(-1, *self.shape)).view(-1, self.proj.out_channels)


@pytest.mark.parametrize("bias", [False, True])
def test_one_patch_per_row_becomes_a_linear_equal_to_the_convolution_at_every_row_count(bias):
    torch.manual_seed(0)
    module = _PatchEmbed(bias=bias).eval()
    gm, call, before = _rewritten(module, torch.randn(5, 96))
    assert (before, _convolutions(gm), op_count(gm, torch.nn.functional.linear)) == (1, 0, 1)
    with torch.no_grad():
        for rows in (1, 2, 7, 33):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(call(x), module(x), rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    channels=st.integers(1, 4),
    kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    tiles=st.integers(1, 4),
    bias=st.booleans(),
)
def test_a_grid_of_patches_gives_the_convolutions_values_shape_and_layout(channels, kernel, grid, tiles, bias):
    """SigLIP's and InternViT's tile patchification (``conv2d`` over ``[N, C, H, W]``, stride = kernel): equal in
    float64, contiguous as the convolution's output, for other tile counts than the traced one."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, 5, kernel, stride=kernel, bias=bias).double().eval()
    size = (grid[0] * kernel[0], grid[1] * kernel[1])
    gm, call, before = _rewritten(conv, torch.randn(2, channels, *size, dtype=torch.float64))
    assert (before, _convolutions(gm)) == (1, 0)
    x = torch.randn(tiles, channels, *size, dtype=torch.float64)
    with torch.no_grad():
        got, expected = call(x), conv(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got.is_contiguous() and got.shape == expected.shape


@pytest.mark.parametrize(
    "conv, size",
    [
        (torch.nn.Conv2d(3, 4, 4, stride=2), 8),  # overlapping windows
        (torch.nn.Conv2d(3, 4, 4, stride=4, padding=1), 8),  # padded
        (torch.nn.Conv2d(4, 4, 4, stride=4, groups=2), 8),  # grouped
        (torch.nn.Conv2d(3, 4, 4, stride=4), 10),  # the input is not whole patches
    ],
    ids=["overlapping", "padded", "grouped", "partial patches"],
)
def test_other_convolutions_are_left_as_they_are(conv, size):
    gm, _, before = _rewritten(conv.eval(), torch.randn(2, conv.in_channels, size, size))
    assert before == _convolutions(gm) == 1
