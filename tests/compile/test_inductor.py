"""Compile once: one inductor compile serves every bucket; a guard inductor adds is checked at each bucket's sizes."""

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.compile.inductor import _added_constraints, _holds
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.spec import BucketShape


def test_a_guard_is_checked_at_each_bucket_size():
    """``s0 >= 855`` (a 32-bit-indexing or matmul choice inductor made) holds in the 1024 bucket, fails in the 256
    one (which is then dropped), and says nothing where the bucket leaves a symbol free."""
    tokens, other = sympy.symbols("s0 s1", integer=True, positive=True)
    small, large = BucketShape(256, {tokens: 256}, (8,), (256,)), BucketShape(1024, {tokens: 1024}, (8,), (1024,))
    guard = sympy.Ge(tokens, 855)
    shape_env = ShapeEnv()
    assert (_holds(guard, small, shape_env), _holds(guard, large, shape_env)) == (False, True)
    assert _holds(sympy.Ge(other, 3), large, shape_env) is None


def test_a_specialization_is_checked_at_the_bucket_sizes_not_through_its_replacement():
    """Inductor specializing a size (``bool(s == 3)`` on a SymInt) records the guard ``Eq(s, 3)`` and the
    replacement ``s -> 3``. Through the replacement the guard reads ``3 == 3`` at any size; checked at the
    bucket's sizes it fails where the bucket holds 7 offsets and holds where the bucket pins 3."""
    shape_env = ShapeEnv()
    offsets = shape_env.create_symbol(3, ConstantSource("cu_seqlens.shape[0]"))
    assert bool(shape_env.create_symintnode(offsets, hint=3) == 3)
    (guard, origin), (replacement, specialized) = _added_constraints(shape_env, 0, {})
    assert guard == replacement == sympy.Eq(offsets, 3)
    assert "test_inductor.py" in origin and specialized == "a size inductor specialized"
    assert shape_env.replace(guard) == sympy.true  # what hid the failure
    padded = BucketShape(64, {offsets: 7}, (6,), (64,))
    pinned = BucketShape(64, {offsets: 3}, (2,), (64,), frozenset({offsets}))
    assert (_holds(guard, padded, shape_env), _holds(guard, pinned, shape_env)) == (False, True)


def test_one_compile_for_every_bucket():
    """Three budgets, one inductor compile; the three buckets run the same compiled code at their sizes. (The
    runtime tests' one-block encoder, so a cold cache compiles it once for both.) nodes_rewritten: the kernel of
    the one site in the eager and compiled copies."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(model, token_budgets=(16, 32, 64), max_segments=4, attention_backend="sdpa")
    with (
        torch.no_grad(),
        counters.expect(traces=1, sites_found=1, nodes_rewritten=2, compiles=1, buckets_built=3, replays=3),
    ):
        for lengths in ([3, 5], [20, 9], [60]):  # one call per bucket
            inputs = pack_images(lengths, 12)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert [bucket.stats.hits for bucket in compiled.vgraph.runtimes[0].buckets] == [1, 1, 1]


def test_another_instance_starts_from_inductors_cache():
    """Parameters are graph inputs, not constants: a fresh trace of another instance (other weights, as a second
    process would load) is served from inductor's on-disk cache, and computes with its own weights."""
    from torch._dynamo.utils import counters as dynamo_counters

    def compile_and_check(seed):
        torch.manual_seed(seed)
        model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
        compiled = vgraph_compile.encoder(model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa")
        inputs = pack_images([5, 7], 12)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)

    compile_and_check(seed=1)
    torch._dynamo.reset()
    dynamo_counters.clear()
    with counters.expect(traces=1, sites_found=1, nodes_rewritten=2, compiles=1, buckets_built=2, replays=1):
        compile_and_check(seed=2)
    hits = dynamo_counters["inductor"]["fxgraph_cache_hit"] + dynamo_counters["aot_autograd"]["autograd_cache_hit"]
    assert hits >= 1 and dynamo_counters["inductor"]["fxgraph_cache_miss"] == 0
