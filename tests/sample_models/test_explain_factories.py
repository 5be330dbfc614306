"""The example encoders end to end against eager: through plain ``torch.compile(dynamic=True)`` and the decorator,
each after a NaN call that leaves NaN in the bucket buffers (a real call must not see it)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import counter_changes
from vgraph_compile.sample_models import explain_factories
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PlacedClsViT, pack_images, place_cls_rows

OPTIONS = {"token_budgets": (64, 256), "max_segments": 6, "compiler": "eager"}


def _nan_call(compiled, inputs):
    """Run a call whose tokens are all NaN, so every bucket buffer it touches holds NaN afterwards."""
    poisoned = (torch.full_like(inputs[0], float("nan")), *inputs[1:])
    with torch.no_grad():
        compiled(*poisoned)


def _compiled(factory, entry, **options):
    """The example encoder of ``factory`` through ``entry``, after a NaN call."""
    model, inputs = getattr(explain_factories, factory)()
    options = {**OPTIONS, **options}
    torch._dynamo.reset()
    if entry == "torch.compile":
        compiled = torch.compile(model, backend="vgraph", dynamic=True, options=options)
    else:
        compiled = vgraph_compile.encoder(model, **options)
    _nan_call(compiled, inputs)
    return model, compiled


ROWS_PER_IMAGE = {"cls_vit": 1, "register_vit": 4}
"""The rows each image adds to its patches in the attention."""


@pytest.fixture(scope="module", params=[("cls_vit", "torch.compile"), ("cls_vit", "decorator"),
                                        ("register_vit", "torch.compile")], ids="-".join)  # fmt: skip
def sum_of_sizes_encoder(request):
    factory, entry = request.param
    return factory, entry, *_compiled(factory, entry)


@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=6))
def test_sum_of_sizes_encoders_match_eager(sum_of_sizes_encoder, lengths):
    """CLS and register rows are scattered in the graph; any images match eager. A call is served by a bucket
    graph when its patches fit the largest budget less one image's extra rows (each size is bounded by the budget
    less the least the others take), the others run eagerly; a call that retraces is served by its new trace. Plain torch.compile specializes a size of 1: a call
    of one patch gets a static trace, run as traced (neither served nor a fallback)."""
    factory, entry, model, compiled = sum_of_sizes_encoder
    inputs = pack_images(lengths, 24)
    fits = sum(lengths) <= OPTIONS["token_budgets"][-1] - ROWS_PER_IMAGE[factory]
    static = entry == "torch.compile" and lengths == [1]
    with torch.no_grad(), counter_changes() as changes:
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    served = fits and not static
    assert (changes["replays"], changes["eager_fallbacks"]) == (int(served), int(not fits and not static)), changes


GRIDS = st.lists(
    st.tuples(st.sampled_from([1, 2]), st.integers(1, 5).map(lambda h: 2 * h), st.integers(1, 5).map(lambda w: 2 * w)),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("entry", ["torch.compile", "decorator"])
def test_windowed_vit_needs_no_torch_check(entry):
    """The window permutation ties tokens to 4x the window index in the graph itself: no torch._check needed."""
    earlier = {runtime.serial for runtime in vgraph_compile.runtimes()}
    geometry = {"geometry": explain_factories.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6, "max_segments": None}
    model, compiled = _compiled("windowed_vit", entry, token_budgets=(256, 1024), **geometry)

    calls = []

    @given(grid=GRIDS)
    def check(grid):
        call = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, grid, 24)
        calls.append(grid)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*call), model(*call), rtol=1e-5, atol=1e-5)

    check()
    (runtime,) = [runtime for runtime in vgraph_compile.runtimes() if runtime.serial not in earlier]
    assert runtime.spec.format().splitlines()[0] == "tokens: 4*window_index.shape[0]"
    # four in five calls replayed (20 of 25), and never more than 20 asked for: calls with one window token retrace
    # (dynamo fixes size 1)
    assert runtime.hits >= min(20, len(calls) * 4 // 5), runtime.stats_table()



@pytest.fixture(scope="module")
def placed():
    """``placed_cls_vit`` through the decorator and through plain torch.compile, each after a NaN call (in this
    order: the decorator's calls skip dynamo, so the reset before the second trace leaves it as it is)."""
    return {entry: _compiled("placed_cls_vit", entry) for entry in ("decorator", "torch.compile")}


PLACED_LENGTHS = st.lists(st.integers(2, 40), min_size=2, max_size=6)
"""Images within the largest budget (6 x 41 rows <= 256), two at least: plain torch.compile retraces a call of one
image (dynamo specializes size 1)."""


@pytest.mark.parametrize("entry", ["torch.compile", "decorator"])
@settings(max_examples=10)
@given(lengths=PLACED_LENGTHS)
def test_rows_placed_by_index_inputs_match_eager(placed, entry, lengths):
    """Patch and CLS rows written by index inputs into patches + images rows: every call within the budgets is one
    replay and matches eager, after a call that left NaN in the buffers."""
    model, compiled = placed[entry]
    inputs = place_cls_rows(lengths, 24)
    with torch.no_grad(), counters.expect(replays=1):
        served = compiled(*inputs)
    torch.testing.assert_close(served, model(*inputs), rtol=1e-5, atol=1e-5)


@settings(max_examples=10)
@given(lengths=PLACED_LENGTHS, data=st.data())
def test_a_nan_image_leaves_the_other_placed_images_unchanged(placed, lengths, data):
    """NaN patches in one image: its CLS and patch rows are NaN as in eager, every other image's rows are the
    clean call's (one replay each)."""
    model, compiled = placed["decorator"]
    clean = place_cls_rows(lengths, 24)
    poisoned_image = data.draw(st.integers(0, len(lengths) - 1))
    start = sum(lengths[:poisoned_image])
    patches = clean[0].clone()
    patches[start : start + lengths[poisoned_image]] = float("nan")
    with torch.no_grad(), counters.expect(replays=2):
        cls_clean, patches_clean = compiled(*clean)
        cls_dirty, patches_dirty = compiled(patches, *clean[1:])
    poisoned_rows = torch.zeros(sum(lengths), dtype=torch.bool)
    poisoned_rows[start : start + lengths[poisoned_image]] = True
    assert cls_dirty[poisoned_image].isnan().all() and patches_dirty[poisoned_rows].isnan().all()
    others = torch.arange(len(lengths)) != poisoned_image
    torch.testing.assert_close(cls_dirty[others], cls_clean[others], rtol=0, atol=0)
    torch.testing.assert_close(patches_dirty[~poisoned_rows], patches_clean[~poisoned_rows], rtol=0, atol=0)
    with torch.no_grad():
        eager = model(patches, *clean[1:])
    torch.testing.assert_close((cls_dirty, patches_dirty), eager, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_placed_rows_through_inductor_match_eager():
    """The one inductor compile of a placement encoder: calls in both buckets are replays and match eager."""
    model = PlacedClsViT(patch_dim=24, dim=32, depth=1, heads=2, out_dim=16).eval()
    torch._dynamo.reset()
    compiled = vgraph_compile.encoder(model, token_budgets=(64, 256), max_segments=6)
    _nan_call(compiled, place_cls_rows([30, 9], 24))
    for lengths in ([3], [20, 1, 9], [100, 60, 2], [40, 40, 40, 40, 40, 40]):
        inputs = place_cls_rows(lengths, 24)
        with torch.no_grad(), counters.expect(replays=1):
            served = compiled(*inputs)
        torch.testing.assert_close(served, model(*inputs), rtol=1e-5, atol=1e-5)
