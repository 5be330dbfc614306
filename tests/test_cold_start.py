"""The headline path as a new user meets it: plain ``torch.compile(encoder, backend="vgraph", dynamic=True)``
with dynamo's default config, inductor, and a cold cache of the test's own. Aot_autograd's tensorify pass restarts
dynamo on such a first trace (``TensorifyScalarRestartAnalysis``); only a build inside dynamo's call of the
backend lets that restart happen. Each encoder: one compile on the first call, then calls of other sizes served by
the buckets (counted replays: an eager fallback fails the test) and equal to eager."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vgraph_compile
from tests.helpers import counter_changes
from vgraph_compile.models import examples
from vgraph_compile.models.packed_vit import ClsViT, PackedViT, WindowedViT, pack_images


class FloatConstantsViT(nn.Module):
    """One SigLIP-like block with float constants in the graph: LayerNorm ``eps=1e-6`` and tanh GELU."""

    def __init__(self, patch_dim: int = 12, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(patch_dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, patches, cu_seqlens, max_seqlen):
        x = self.embed(patches)
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, -1).unbind(1)
        x = x + self.proj(vgraph_compile.varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class PositionTableViT(PackedViT):
    """PackedViT with a learned position table indexed per token by each patch's position in its image."""

    def __init__(self, *args, positions: int = 64, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.position = nn.Embedding(positions, self.embed.out_features)

    def forward(self, patches, cu_seqlens, max_seqlen, position_ids):
        x = self.embed(patches) + self.position(position_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen)
        return self.merger(self.norm(x))


def _with_positions(lengths):
    return (*pack_images(lengths, 12), torch.cat([torch.arange(length) for length in lengths]))


def _windowed(grid):
    return examples.windowed_inputs(examples.QWEN25_GEOMETRY, grid, 12)


WINDOWED_OPTIONS = {"geometry": examples.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6, "max_segments": None}

ENCODERS = {
    # name: (encoder factory, extra options, inputs of a call, the first call then calls of other sizes); no call
    # has a size of 1 or a token count equal to a width (dynamo specializes those on a plain first trace)
    "float constants": (
        lambda: FloatConstantsViT(),
        {},
        lambda lengths: pack_images(lengths, 12),
        ([5, 9], [3, 30, 20], [40], [2, 2, 2, 2, 2, 2]),
    ),
    "position table": (
        lambda: PositionTableViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8),
        {},
        _with_positions,
        ([5, 9], [31, 2], [64, 50, 7], [3, 3, 3]),
    ),
    "window permutation": (
        lambda: WindowedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8),
        WINDOWED_OPTIONS,
        _windowed,
        ([(1, 8, 12), (1, 4, 4)], [(1, 4, 8)], [(2, 8, 8), (1, 2, 4)], [(1, 12, 12), (1, 4, 4), (1, 2, 2)]),
    ),
    "CLS rows": (
        lambda: ClsViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8),
        {},
        lambda lengths: pack_images(lengths, 12),
        # ClsViT's cu_seqlens[1:-1] makes dynamo guard on 3 or more images: calls of 1 or 2 retrace
        ([5, 9, 4], [2, 3, 4, 5], [30, 30, 30], [20] * 6),
    ),
}


@pytest.mark.parametrize("name", ENCODERS)
def test_plain_torch_compile_on_a_cold_cache(name, cold_inductor_cache):
    _compile_and_serve(*ENCODERS[name], cold_inductor_cache)


def _compile_and_serve(build, options, make_inputs, calls, cache_directory):
    """Compile ``build()`` with plain torch.compile and call it on ``calls``: one trace and one compile, every
    call served by a bucket and equal to eager, and inductor's files written in ``cache_directory``."""
    torch.manual_seed(0)
    model = build().eval()
    compiled = torch.compile(
        model,
        backend="vgraph",
        dynamic=True,
        options={"token_budgets": [64, 256], "max_segments": 6, **options},
    )
    with torch.inference_mode(), counter_changes() as changes:
        for sizes in calls:
            inputs = make_inputs(sizes)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert (changes["traces"], changes["compiles"], changes["static_traces"]) == (1, 1, 0), changes
    assert (changes["replays"], changes["eager_fallbacks"]) == (len(calls), 0), changes
    runtime = vgraph_compile.runtimes()[-1]
    assert runtime.hits == len(calls), runtime.stats_table()
    assert any(path.is_file() for path in cache_directory.rglob("*")), "inductor wrote outside the test's cache"
