import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

from tests.helpers import trace
from vgraph_compile.analyze import tile_rows
from vgraph_compile.analyze.tile_rows import TileMixingError
from vgraph_compile.config import VGraphConfig


class PerTile(torch.nn.Module):
    """Convolution, reshape keeping the tiles, layer norm, self-attention with a batch dim, a per-tile mean."""

    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.norm = torch.nn.LayerNorm(8)
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, pixel_values):
        x = self.norm(self.patch(pixel_values).flatten(2).transpose(1, 2))
        q, k, v = self.qkv(x).view(x.shape[0], -1, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape[0], -1, 8)
        return out, out.mean(dim=1)


def _run(module, tiles=3):
    gm, ctx = trace(module, torch.randn(tiles, 3, 8, 8), config=VGraphConfig(token_budgets=(1, 2, 4)))
    tile_rows.run(gm, ctx)
    return gm, ctx


def test_independent_rows_give_a_spec_over_the_tile_count():
    """The tile count is the token rows; pixel_values is a padded input; both outputs narrow along dim 0."""
    gm, ctx = _run(PerTile())
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: pixel_values.shape[0]
input pixel_values: tokens dims=[0]
inputs: 6 parameters and module state (used in place)""",
    )
    assert [len(shape) for shape in ctx.spec.outputs] == [3, 2]


class BatchStatistics(torch.nn.Module):
    def forward(self, pixel_values):
        return pixel_values - pixel_values.mean(dim=0, keepdim=True)


class CrossTileAttention(torch.nn.Module):
    def forward(self, pixel_values):
        x = pixel_values.flatten(1)[None]  # [1, tiles, features]: the tiles are the sequence
        return F.scaled_dot_product_attention(x, x, x)[0]


class TrainingBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(3)

    def forward(self, pixel_values):
        return self.norm(pixel_values)


class ShiftedTiles(torch.nn.Module):
    def forward(self, pixel_values):
        return torch.cat([pixel_values[1:], pixel_values[:1]])


class MergedRows(torch.nn.Module):
    """Janus's attention: tiles merged with their tokens (``[N*L, heads, d]``), normalized per row, split back."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, pixel_values):
        x = pixel_values.flatten(2).transpose(1, 2)  # [N, 64, 3]
        rows = self.norm(x.reshape(-1, 3).repeat(1, 4)[:, :4]) * 2 + 1  # [N*64, 4]
        return rows.reshape(pixel_values.shape[0], 64, 4).mean(dim=1)


class MergedSum(torch.nn.Module):
    def forward(self, pixel_values):
        return pixel_values.reshape(-1, 64).sum(dim=0, keepdim=True).expand(pixel_values.shape[0] * 3, 64)


class WritesInPlace(torch.nn.Module):
    """An in-place write of tiles into a tensor the analysis saw as untiled: refused (its later uses would be
    read as untiled)."""

    def forward(self, pixel_values):
        total = pixel_values.new_zeros(pixel_values.shape)
        total.add_(pixel_values)
        return total


class ScaledByCount(torch.nn.Module):
    def forward(self, pixel_values):
        return pixel_values / pixel_values.shape[0]


def test_a_tile_dim_merged_into_rows_and_split_back_keeps_tiles_apart():
    _, ctx = _run(MergedRows())
    assert [len(shape) for shape in ctx.spec.outputs] == [2]


@pytest.mark.parametrize(
    "module, named",
    [
        (BatchStatistics(), "reduces over the tile dim"),
        (CrossTileAttention(), "scaled_dot_product_attention"),
        (TrainingBatchNorm().train(), "batch statistics"),
        (ShiftedTiles(), "slices the tile dim"),
        (MergedSum(), "reduces over the tile dim"),
        (WritesInPlace(), "in place"),
        (ScaledByCount(), "from the tile count"),
    ],
)
def test_a_tower_that_mixes_tiles_is_refused_naming_the_op(module, named):
    """Batch statistics, attention across tiles, batch norm in training, a shift of the tiles: each names its op."""
    with pytest.raises(TileMixingError, match=named):
        _run(module)


def test_batch_norm_with_running_statistics_keeps_tiles_apart():
    _, ctx = _run(TrainingBatchNorm().eval())
    assert ctx.spec.format().startswith("tokens: pixel_values.shape[0]\ninput pixel_values: tokens dims=[0]")


def _static(module, tiles, budget):
    pixel_values = torch.randn(tiles, 3, 8, 8)
    torch._dynamo.mark_static(pixel_values, 0)
    config = VGraphConfig(token_budgets=(budget,), static_rows=True)
    gm, ctx = trace(module, pixel_values, config=config)
    tile_rows.run(gm, ctx)
    return ctx


def test_a_static_trace_of_one_tile_has_that_count_as_its_token_rows():
    """``static_rows``: the one-tile trace is static, pixel_values an input copied as is, both outputs one row."""
    ctx = _static(PerTile(), tiles=1, budget=1)
    assert_expected_inline(
        ctx.spec.format(),
        """\
tokens: 1
input pixel_values: static
inputs: 6 parameters and module state (used in place)""",
    )
    assert [shape[0] for shape in ctx.spec.outputs] == [1, 1]


def test_a_static_trace_of_another_count_than_its_budget_is_refused():
    with pytest.raises(ValueError, match=r"no input of the static trace has 1 rows in dim 0 \(its inputs have \[2\]\)"):
        _static(PerTile(), tiles=2, budget=1)
