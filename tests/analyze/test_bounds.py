import itertools

import pytest
import sympy
import torch
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import trace
from vgraph_compile.config import VGraphConfig
from vgraph_compile.sample_models.packed_vit import PackedViT, PlacedClsViT, pack_images
from vgraph_compile.analyze import bounds, discover


def _bounds(gm, ctx):
    discover.run(gm, ctx)
    bounds.run(gm, ctx)
    return "\n".join(bucket.format(ctx.spec) for bucket in ctx.buckets)


def test_bucket_sizes(tiny):
    """Tokens solve to the budget, segments to max_segments (+1 offsets), max_seqlen to the budget."""
    _, gm, ctx = tiny
    assert_expected_inline(
        _bounds(gm, ctx),
        """\
budget 16: segments=[4] max_seqlen=[16] (cu_seqlens.shape[0]<=5 max_seqlen<=16 patches.shape[0]<=16)
budget 64: segments=[4] max_seqlen=[64] (cu_seqlens.shape[0]<=5 max_seqlen<=64 patches.shape[0]<=64)""",
    )


def test_output_ranges_from_bound_sympy(tiny):
    _, gm, ctx = tiny
    _bounds(gm, ctx)
    ((rows, width),) = bounds.output_ranges(ctx.spec, ctx.buckets[1])
    assert (rows.lower, rows.upper, width.lower, width.upper) == (1, 64, 8, 8)


def test_budget_breaking_a_traced_guard_is_refused():
    """A 2x2 merge needs token counts divisible by 4: budget 18 cannot run and says which constraint fails."""
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8, merge=4).eval()
    gm, ctx = trace(model, *pack_images([8, 12], 12), config=VGraphConfig(token_budgets=(16, 18)))
    with pytest.raises(ValueError, match="budget 18 breaks the traced constraint"):
        _bounds(gm, ctx)


def test_a_guard_is_checked_as_recorded_not_through_the_facts_it_gives():
    """The guard ``T // (T // 4) == 4`` is a fact that simplifies sizes (``symbolic.canonical`` proves the floor
    division is 4 from it), so through ``canonical`` it would read ``True`` at any budget. Checked as recorded,
    budget 6 (``6 // 1 == 6``) breaks it and is refused; 16 and 20 hold it."""
    from vgraph_compile.kernels.ops import varlen_attention

    def encoder(x, cu, max_seqlen):
        torch._check(x.shape[0] // (x.shape[0] // 4) == 4)
        return varlen_attention(*(x.view(x.shape[0], 1, -1),) * 3, cu, max_seqlen)

    inputs = torch.randn(16, 6), torch.tensor([0, 8, 16], dtype=torch.int32), 8
    for budgets, refused in (((16, 20), None), ((6, 16), 6)):
        gm, ctx = trace(encoder, *inputs, config=VGraphConfig(token_budgets=budgets, max_segments=2))
        discover.run(gm, ctx)
        if refused is None:
            assert [bucket.budget for bucket in bounds.bucket_shapes(ctx)] == list(budgets)
            continue
        with pytest.raises(bounds.BudgetRefused, match=rf"budget {refused} breaks the traced constraint "):
            bounds.bucket_shapes(ctx)


def test_unrelated_dynamic_dim_is_fixed_at_its_traced_value():
    """A feature width that dynamic=True left symbolic is pinned (==) at its traced value, not bounded by a guess."""

    def encoder(x, cu, max_seqlen):
        q = x.view(x.shape[0], 1, x.shape[1])
        from vgraph_compile.kernels.ops import varlen_attention

        return varlen_attention(q, q, q, cu, max_seqlen)

    gm, ctx = trace(
        encoder,
        torch.randn(10, 6),
        torch.tensor([0, 4, 10], dtype=torch.int32),
        6,
        config=VGraphConfig(token_budgets=(16,), max_segments=2),
        static_widths=False,
    )
    assert_expected_inline(
        _bounds(gm, ctx),
        """budget 16: segments=[2] max_seqlen=[16] (cu.shape[0]<=3 max_seqlen<=16 x.shape[0]<=16 x.shape[1]==6)""",
    )


def _windowed(config_fields):
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_vit

    model, inputs = windowed_vit()
    config = VGraphConfig(token_budgets=(1024, 4096), geometry=QWEN25_GEOMETRY, max_items=4, **config_fields)
    return trace(model, *inputs, config=config)


def test_geometry_sizes_frames_and_windows():
    """The window group (its offsets named in window_offsets) gets the tight window bound and max_seqlen w^2 m^2 = 64;
    the frame group max_items frames and the whole budget as max_seqlen."""
    gm, ctx = _windowed({})
    assert_expected_inline(
        _bounds(gm, ctx),
        """\
budget 1024: segments=[67, 4] max_seqlen=[64, 1024] (cu_seqlens.shape[0]<=5 cu_window_seqlens.shape[0]<=68 max_seqlen<=1024 max_window_seqlen<=64 window_index.shape[0]<=256)
budget 4096: segments=[259, 4] max_seqlen=[64, 4096] (cu_seqlens.shape[0]<=5 cu_window_seqlens.shape[0]<=260 max_seqlen<=4096 max_window_seqlen<=64 window_index.shape[0]<=1024)""",
    )


def test_conservative_window_bound_for_the_ablation():
    """window_bound='conservative' sizes window segments by the token budget, as vLLM did before #42796."""
    gm, ctx = _windowed({"window_bound": "conservative"})
    assert_expected_inline(
        _bounds(gm, ctx),
        """\
budget 1024: segments=[1024, 4] max_seqlen=[64, 1024] (cu_seqlens.shape[0]<=5 cu_window_seqlens.shape[0]<=1025 max_seqlen<=1024 max_window_seqlen<=64 window_index.shape[0]<=256)
budget 4096: segments=[4096, 4] max_seqlen=[64, 4096] (cu_seqlens.shape[0]<=5 cu_window_seqlens.shape[0]<=4097 max_seqlen<=4096 max_window_seqlen<=64 window_index.shape[0]<=1024)""",
    )


@given(
    coefficients=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    constant=st.integers(-3, 3),
    least=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    budget=st.integers(1, 30),
)
def test_token_caps_are_the_largest_size_of_any_call_in_the_budget(coefficients, constant, least, budget):
    """For rows = c + sum(k_i s_i), each cap equals the largest s_i over every call (s_j >= lo_j, rows <= budget),
    found by brute force: no call exceeds it (sound) and one reaches it (tight)."""
    symbols = sympy.symbols(f"s0:{len(coefficients)}", integer=True, positive=True)
    rows = constant + sum(k * s for k, s in zip(coefficients, symbols))
    lows = dict(zip(symbols, least))
    calls = [
        sizes
        for sizes in itertools.product(*(range(lows[s], budget - constant + 1) for s in symbols))
        if constant + sum(k * v for k, v in zip(coefficients, sizes)) <= budget
    ]
    if not calls:
        with pytest.raises(ValueError, match=f"budget {budget} holds no call"):
            bounds.token_caps(rows, budget, lows)
        return
    caps = bounds.token_caps(rows, budget, lows)
    assert caps == {s: max(call[i] for call in calls) for i, s in enumerate(symbols)}


@pytest.fixture(scope="module")
def cls_context():
    """The CLS encoder's pass context after discovery and bounds, budgets (32, 128), 6 segments."""
    from vgraph_compile.sample_models.explain_factories import cls_vit

    model, inputs = cls_vit()
    config = VGraphConfig(token_budgets=(32, 128), max_segments=6, compiler="eager")
    gm, ctx = trace(model, *inputs, config=config)
    discover.run(gm, ctx)
    bounds.run(gm, ctx)
    return ctx


def test_cls_rows_are_a_sum_of_patches_and_images(cls_context):
    """A CLS row per image: the budget bounds patches + images; 6 segments, and patches <= budget - 1 image."""
    ctx = cls_context
    assert_expected_inline(
        ctx.spec.format().splitlines()[0] + "\n" + "\n".join(bucket.format(ctx.spec) for bucket in ctx.buckets),
        """\
tokens: cu_seqlens.shape[0] + patches.shape[0] - 1
budget 32: segments=[6] max_seqlen=[32] (cu_seqlens.shape[0]<=7 max_seqlen<=32 patches.shape[0]<=31)
budget 128: segments=[6] max_seqlen=[128] (cu_seqlens.shape[0]<=7 max_seqlen<=128 patches.shape[0]<=127)""",
    )


@given(lengths=st.lists(st.integers(1, 127), min_size=1, max_size=6))
def test_every_cls_call_within_a_budget_fits_its_bucket(cls_context, lengths):
    """Any call of <= 6 images whose rows (patches + images) are within a budget fits that budget's bucket."""
    ctx = cls_context
    real = {"patches.shape[0]": sum(lengths), "cu_seqlens.shape[0]": len(lengths) + 1}
    sizes = {symbol: real[ctx.spec.describe(symbol)] for symbol in ctx.spec.token_symbols}
    rows = sum(lengths) + len(lengths)
    for bucket in ctx.buckets:
        fits = all(value <= bucket.values[symbol] for symbol, value in sizes.items())
        assert fits or rows > bucket.budget, f"{lengths} ({rows} rows) does not fit budget {bucket.budget}"


def test_a_size_pinned_after_discovery_is_held_in_every_bucket():
    """Inductor specializes ``cu_seqlens[1:-1]`` of a two-image ClsViT trace (a length-1 slice) by pinning
    ``cu_seqlens.shape[0] == 3`` in the trace's ShapeEnv while it compiles. The buckets derived afterwards hold
    that size (==), 2 segments, and patches <= budget - 2 CLS rows; before the pin, 6 segments and <= budget - 1."""
    from vgraph_compile.sample_models.packed_vit import ClsViT

    model = ClsViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    config = VGraphConfig(token_budgets=(32, 128), max_segments=6, compiler="eager")
    gm, ctx = trace(model, *pack_images([12, 20], 12), config=config, plain=True)
    discover.run(gm, ctx)
    (offsets,) = [s for s in ctx.spec.token_symbols if ctx.spec.describe(s) == "cu_seqlens.shape[0]"]
    assert bounds.pinned_sizes(ctx) == {}
    assert [shape.segments for shape in bounds.bucket_shapes(ctx)] == [(6,), (6,)]
    assert bool(ctx.shape_env.create_symintnode(offsets, hint=3) == 3)  # inductor's 0/1 specialization
    assert bounds.pinned_sizes(ctx) == {offsets: 3}
    assert_expected_inline(
        "\n".join(shape.format(ctx.spec) for shape in bounds.bucket_shapes(ctx)),
        """\
budget 32: segments=[2] max_seqlen=[32] (cu_seqlens.shape[0]==3 max_seqlen<=32 patches.shape[0]<=30)
budget 128: segments=[2] max_seqlen=[128] (cu_seqlens.shape[0]==3 max_seqlen<=128 patches.shape[0]<=126)""",
    )


def test_window_group_is_named_not_guessed_from_the_traced_image():
    """Traced on one image of exactly one window (as many windows as frames), the group of cu_window_seqlens still
    gets the window bound: the config names it; the shape of the traced call does not matter."""
    from vgraph_compile.sample_models.explain_factories import QWEN25_GEOMETRY, windowed_inputs, windowed_vit

    model, _ = windowed_vit()
    inputs = windowed_inputs(QWEN25_GEOMETRY, [(1, 8, 8)], 24)
    config = VGraphConfig(token_budgets=(1024,), geometry=QWEN25_GEOMETRY, max_items=4)
    gm, ctx = trace(model, *inputs, config=config)
    assert inputs[1].shape == inputs[3].shape, "one frame, one window"
    assert_expected_inline(_bounds(gm, ctx).split(" (")[0], """budget 1024: segments=[67, 4] max_seqlen=[64, 1024]""")
    unnamed = VGraphConfig(token_budgets=(1024,), geometry=QWEN25_GEOMETRY, max_items=4, window_offsets=())
    gm, ctx = trace(model, *inputs, config=unnamed)
    assert_expected_inline(
        _bounds(gm, ctx).split(" (")[0], """budget 1024: segments=[67, 67] max_seqlen=[1024, 1024]"""
    )


class TiedPlacedClsViT(PlacedClsViT):
    """PlacedClsViT with its CLS count tied to the segment count."""

    def forward(self, patches, cu_seqlens, max_seqlen, cls_rows, patch_rows):
        torch._check(cls_rows.shape[0] == cu_seqlens.shape[0] - 1)
        return super().forward(patches, cu_seqlens, max_seqlen, cls_rows, patch_rows)


def test_placement_indices_get_the_sizes_of_what_they_place():
    """Placement indices take no bound from the dim they write (it is longer than they are): untied, the CLS rows
    get the budget like the patches; tied to the segments, as many as the segments."""
    from vgraph_compile.sample_models.explain_factories import placed_cls_vit

    model, inputs = placed_cls_vit()
    tied = TiedPlacedClsViT(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16)
    config = VGraphConfig(token_budgets=(32,), max_segments=6, compiler="eager")
    shapes = []
    for encoder in (model, tied):
        gm, ctx = trace(encoder, *inputs, config=config)
        discover.run(gm, ctx)
        bounds.run(gm, ctx)
        shapes.append(ctx.buckets[0].format(ctx.spec))
    assert_expected_inline(
        "\n".join(shapes),
        """\
budget 32: segments=[6] max_seqlen=[32] (cls_rows.shape[0]<=32 cu_seqlens.shape[0]<=7 max_seqlen<=32 patches.shape[0]<=32)
budget 32: segments=[6] max_seqlen=[32] (cls_rows.shape[0]<=6 max_seqlen<=32 patches.shape[0]<=31)""",
    )
