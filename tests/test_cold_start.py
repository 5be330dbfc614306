"""The headline path as a new user meets it: plain ``torch.compile(encoder, backend="vgraph", dynamic=True)``
with dynamo's default config, inductor, and one cold cache for the module (the first test compiles cold; the
others reuse its C++ kernels). Aot_autograd's tensorify pass restarts
dynamo on such a first trace (``TensorifyScalarRestartAnalysis``); only a build inside dynamo's call of the
backend lets that restart happen. Each encoder: one compile on the first call, then calls of other sizes served by
the buckets (counted replays: an eager fallback fails the test) and equal to eager. ClsViT splits its image counts
into three traces, one of them specialized by inductor: each is compiled once and bucketed at its own sizes."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vgraph_compile
from tests.helpers import THOROUGH, counter_changes
from vgraph_compile.sample_models import explain_factories
from vgraph_compile.sample_models.packed_vit import ClsViT, PackedViT, WindowedViT, pack_images

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)


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
    return explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, grid, 12)


WINDOWED_OPTIONS = {"geometry": explain_factories.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6, "max_segments": None}

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
}


@pytest.mark.parametrize("name", ENCODERS if THOROUGH else ["window permutation"])
def test_plain_torch_compile_on_a_cold_cache(name, cold_inductor_cache):
    """Each encoder compiled cold (the default profile compiles the windowed one, whose permutation, window and
    frame bounds cover the most of the pipeline; ``HYPOTHESIS_PROFILE=thorough`` compiles all three)."""
    _compile_and_serve(*ENCODERS[name], cold_inductor_cache)


CLS_VIT = (
    lambda: ClsViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8),
    {},
    lambda lengths: pack_images(lengths, 12),
)

CLS_IMAGE_COUNTS = {
    # first call: the calls, as patches per image. ClsViT's cu_seqlens[1:-1] splits the image counts into three
    # traces: dynamo fixes one image (cu_seqlens.shape[0] == 2); inductor fixes two (its length-1 slice) and
    # guards three or more. 3 traces, 3 compiles, every call a replay.
    "two images first": ([5, 9], [4, 6, 7], [7], [3, 30, 20, 2, 5], [11, 2], [20, 6, 9]),
    "three images first": ([4, 6, 7], [11, 2], [3, 30, 20, 2, 5], [7], [5, 9], [30]),
}


def test_cls_rows_at_one_two_three_and_five_images(cold_inductor_cache):
    """The trace that inductor specialized at two images (``cu_seqlens.shape[0] == 3``) is bucketed at that
    size, not padded to the budget's segment count: its calls replay and equal eager, in either order. The first
    order compiles its three graphs, new to the module's cache; the second, after a dynamo reset, loads them from
    inductor's cache, which adds the same specialization to its new trace."""
    from torch._dynamo.utils import counters as dynamo_counters

    cache_lookups = [(0, 3), (3, 0)]  # (hits, misses) of inductor's FX graph cache: compiled, then loaded
    for calls, lookups in zip(CLS_IMAGE_COUNTS.values(), cache_lookups, strict=True):
        torch._dynamo.reset()
        dynamo_counters.clear()
        _compile_and_serve(*CLS_VIT, calls, cold_inductor_cache, traces=3)
        traces = vgraph_compile.runtimes()[-3:]
        (two_images,) = [runtime for runtime in traces if runtime.buckets[0].shape.segments == (2,)]
        assert [bucket.stats.hits for bucket in two_images.buckets] == [2, 0], two_images.stats_table()
        inductor = dynamo_counters["inductor"]
        assert (inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]) == lookups, dict(dynamo_counters)


def _compile_and_serve(build, options, make_inputs, calls, cache_directory, traces=1):
    """Compile ``build()`` with plain torch.compile and call it on ``calls``: ``traces`` traces, one compile each,
    every call served by a bucket and equal to eager, and inductor's files written in ``cache_directory`` (new ones
    where a graph missed its cache)."""
    from torch._dynamo.utils import counters as dynamo_counters

    before = {path for path in cache_directory.rglob("*") if path.is_file()}
    misses = dynamo_counters["inductor"]["fxgraph_cache_miss"]
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
    assert (changes["traces"], changes["compiles"], changes["static_traces"]) == (traces, traces, 0), changes
    assert (changes["replays"], changes["eager_fallbacks"], changes["buckets_dropped"]) == (len(calls), 0, 0), changes
    served = vgraph_compile.runtimes()[-traces:]
    assert sum(runtime.hits for runtime in served) == len(calls), [runtime.stats_table() for runtime in served]
    written = {path for path in cache_directory.rglob("*") if path.is_file()} - before
    assert written or dynamo_counters["inductor"]["fxgraph_cache_miss"] == misses, "inductor wrote outside its cache"
