"""The example encoders end to end against eager: through plain ``torch.compile(dynamic=True)`` and the decorator,
each after a NaN call that leaves NaN in the bucket buffers (a real call must not see it)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import counter_changes
from vgraph_compile.models import examples
from vgraph_compile.models.packed_vit import pack_images

OPTIONS = {"token_budgets": (64, 256), "max_segments": 6, "compiler": "eager"}


def _nan_call(compiled, inputs):
    """Run a call whose tokens are all NaN, so every bucket buffer it touches holds NaN afterwards."""
    poisoned = (torch.full_like(inputs[0], float("nan")), *inputs[1:])
    with torch.no_grad():
        compiled(*poisoned)


def _compiled(factory, entry, **options):
    """The example encoder of ``factory`` through ``entry``, after a NaN call."""
    model, inputs = getattr(examples, factory)()
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
    geometry = {"geometry": examples.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6, "max_segments": None}
    model, compiled = _compiled("windowed_vit", entry, token_budgets=(256, 1024), **geometry)

    @given(grid=GRIDS)
    def check(grid):
        call = examples.windowed_inputs(examples.QWEN25_GEOMETRY, grid, 24)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*call), model(*call), rtol=1e-5, atol=1e-5)

    check()
    (runtime,) = [runtime for runtime in vgraph_compile.runtimes() if runtime.serial not in earlier]
    assert runtime.spec.format().splitlines()[0] == "tokens: 4*window_index.shape[0]"
    assert runtime.hits >= 20, runtime.stats_table()  # calls with one window token retrace (dynamo fixes size 1)
