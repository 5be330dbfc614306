"""Compile once: one inductor compile serves every bucket; a guard inductor adds is checked at each bucket's sizes,
and a compile that leaves no bucket is refused in the user's names."""

import re

import pytest
import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.analyze.bounds import BudgetRefused
from vgraph_compile.compile.inductor import _added_constraints, _holds, size_guards
from vgraph_compile.config import VGraphConfig
from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs
from vgraph_compile.sample_models.packed_vit import PackedViT, WindowedViT, pack_images
from vgraph_compile.spec import BucketShape, PassContext


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


def test_size_guards_leave_out_a_guard_the_replacements_make_true():
    """``a != b + 1`` and ``a == b``, recorded as ``a == b`` made ``a`` and ``b`` one size, read ``True`` once ``b``
    is replaced by ``a``: they constrain nothing and are left out (saved, each was the text ``True``); ``a >= 3``
    is kept."""
    shape_env = ShapeEnv(duck_shape=False)
    first, second = (shape_env.create_symbol(8, ConstantSource(name)) for name in ("a.shape[0]", "b.shape[0]"))
    a, b = (shape_env.create_symintnode(symbol, hint=8) for symbol in (first, second))
    assert bool(a != b + 1) and bool(a >= 3) and bool(a == b)
    assert shape_env.replace(second) == first and len(shape_env.guards) == 3
    ctx = PassContext([], shape_env, VGraphConfig(token_budgets=(16,)), torch.device("cpu"))
    ctx.buckets = (BucketShape(16, {first: 16}, (1,), (16,)),)
    assert size_guards(ctx) == (sympy.Ge(first, 3),)


def test_a_compile_that_leaves_no_bucket_is_refused_naming_the_guards():
    """A first call of one merge unit (Qwen2.5-VL's window permutation over a ``window_index`` of length 1):
    inductor lowers the permutation's reshape for that length only (``Eq(1, window_index.shape[0])``), which no
    bucket (16 and 64 merge units) holds. Every budget is dropped, and the call that traced raises a
    ``BudgetRefused`` naming each budget, the guard in the user's names and what to do (it was ``max() arg is an
    empty sequence`` while allocating the buffers)."""
    torch.manual_seed(0)
    model = WindowedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8, full_attention_blocks=()).eval()
    encoder = vgraph_compile.encoder(model, token_budgets=(64, 256), geometry=QWEN25_GEOMETRY, max_items=3,
                                     window_offsets=("cu_window_seqlens",))  # fmt: skip
    with torch.no_grad(), pytest.raises(BudgetRefused) as refused:
        encoder(*windowed_inputs(QWEN25_GEOMETRY, [(1, 2, 2)], 12))
    message = str(refused.value)
    assert message.startswith("every token budget [64, 256] was dropped, so no bucket serves this encoder: ")
    for budget in (64, 256):
        guard = r"Eq\((1, window_index\.shape\[0\]|window_index\.shape\[0\], 1)\)"  # sympy orders the two sides
        assert re.search(rf"budget {budget}: the compiled code assumes {guard} \(from ", message), message
    assert "trace on a call with more than one of it (items, merge units, windows)" in message


@pytest.mark.parametrize(
    "hint, columns, persistent",
    [
        ("INNER", 1152, True),
        ("INNER", 2048, True),
        ("INNER", 2049, False),
        ("INNER", 512, True),
        ("OUTER", 1152, False),
    ],
)
def test_row_reductions_up_to_2048_columns_are_persistent_during_the_compile_only(hint, columns, persistent):
    """A norm over a ViT's 1152-1536 wide rows reads each row once (inductor's own limit is 1024); other reductions
    keep inductor's choice; the user's handler is back after the compile."""
    from types import SimpleNamespace

    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    from vgraph_compile.compile.inductor import _inductor_heuristics

    features = SimpleNamespace(
        get_reduction_hint=lambda: getattr(ReductionHint, hint), reduction_numel=sympy.Integer(columns), numel=1
    )
    before = V.choices
    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())), _inductor_heuristics():
        assert V.choices.should_use_persistent_reduction(features, cooperative_reduction=False) is persistent
    assert V.choices is before
