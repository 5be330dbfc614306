"""Every fixed-tile tower family of the installed transformers, tiny and random, served by vgraph tile buckets."""

import importlib
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import THOROUGH
from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vlm
from vgraph_compile.hf.whole_graph.tiles import compile_tile_tower, is_tile_tower, tile_buckets
from vgraph_compile.hf.vlm import find_vision_tower

transformers = pytest.importorskip("transformers", minversion="5.23")

FAMILIES = (
    "gemma3", "paligemma", "llava_onevision", "aya_vision", "cohere2_vision", "deepseek_vl",  # SigLIP
    "llava", "llava_next", "vipllava",  # CLIP
    "idefics2", "idefics3", "smolvlm", "granite_docling",  # SigLIP-style with a patch mask
    "internvl", "janus", "ovis2", "got_ocr2",
)  # fmt: skip
"""The VLM families whose tower takes a batch of same-size images (issue table); their towers are built from the
families' own configs below, so a family whose tower class others share is tested once per tower class."""
TINY = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
)
"""One block (each block adds to the dynamo trace every test makes; the blocks of a tower are alike)."""
SAM = dict(mlp_dim=64, output_channels=16, window_size=2, global_attn_indexes=[1])
"""GOT-OCR2's SAM encoder: a windowed layer, then a global one (two blocks where a config has
``global_attn_indexes``)."""
MAX_ITEMS, EXACT_ITEMS = 10, 4
# buckets 1, 2, 3, 4, 5, 7, 8, 10: N = 1, 2, 7 (a prime and exactly a bucket), 10 (max_items), 16 (past
# max_items: 10 + 6, two graph calls, the 6 padded to the bucket of 7)
CALLS = (1, 2, 7, 10, 16)


def _set(config, values):
    for name, value in values.items():
        if hasattr(config, name):
            pair = isinstance(value, int) and isinstance(getattr(config, name), (list, tuple))
            setattr(config, name, [value, value] if pair else value)


def _vision_config(family: str):
    vision = transformers.CONFIG_MAPPING[family]().vision_config
    _set(vision, {**TINY, **SAM})
    if hasattr(vision, "global_attn_indexes"):
        vision.num_hidden_layers = 2
    return vision


def tower_class(family: str) -> type:
    """The class transformers maps the family's vision config to (AutoModel), else the family's module class whose
    config_class is that config."""
    kind = type(transformers.CONFIG_MAPPING[family]().vision_config)
    if kind in transformers.MODEL_MAPPING:
        return transformers.MODEL_MAPPING[kind]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    (cls,) = [
        c
        for name, c in vars(module).items()
        if inspect.isclass(c) and getattr(c, "config_class", None) is kind and "PreTrained" not in name
    ]
    return cls


def tiny_tower(family: str) -> torch.nn.Module:
    """The family's vision tower (``tower_class``) from its own vision config, shrunk."""
    tower = tower_class(family)(_vision_config(family))
    torch.manual_seed(0)
    for parameter in tower.parameters():  # random weights large enough to make every layer matter
        torch.nn.init.normal_(parameter, std=0.2)
    return tower.eval()


def _towers() -> dict[str, str]:
    """One family per tower class: tower class name -> family."""
    seen = {}
    for family in FAMILIES:
        if family in transformers.CONFIG_MAPPING:
            seen.setdefault(tower_class(family).__name__, family)
    return seen


TOWERS = _towers()
SERVED = sorted(TOWERS.values())


def _pixels(tiles: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tiles, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _assert_outputs_equal(got, want):
    for name, value in want.items():
        values = value if isinstance(value, tuple) else (value,)
        served = getattr(got, name)
        for mine, theirs in zip(served if isinstance(served, tuple) else (served,), values):
            if theirs is None:
                assert mine is None
                continue
            error = (mine - theirs).abs().max() / theirs.abs().max()
            assert error <= 1e-5, f"{name}: relative error {error}"


@given(st.integers(1, 200), st.integers(1, 16), st.sampled_from([1.1, 1.25, 1.5, 2.0]))
def test_tile_buckets_cover_every_count_with_bounded_padding(max_items, exact_items, growth):
    counts = tile_buckets(max_items, exact_items, growth)
    assert counts[: min(exact_items, max_items)] == tuple(range(1, min(exact_items, max_items) + 1))
    assert counts[-1] == max_items and list(counts) == sorted(set(counts))
    for smaller, larger in zip(counts[exact_items - 1 :], counts[exact_items:]):
        assert larger <= math.ceil(smaller * growth**1.5)


def test_every_family_of_the_issue_has_a_tower_class():
    assert {"SiglipVisionModel", "CLIPVisionModel", "Idefics3VisionTransformer", "InternVLVisionModel"} <= set(TOWERS)
    assert all(is_tile_tower(tiny_tower(family)) for family in TOWERS.values())


@pytest.mark.parametrize("family", ["lfm2_vl", "mistral3", "qwen2_5_vl"])
def test_variable_size_towers_are_not_tile_towers(family):
    """SigLIP2 NaFlex (spatial_shapes), Pixtral (image_sizes) and Qwen (grid_thw) take images of several sizes."""
    assert not is_tile_tower(tiny_tower(family))
    with pytest.raises(ValueError, match="is not a fixed-tile tower"):
        compile_tile_tower(tiny_tower(family))


@pytest.fixture(scope="module")
def bucketed():
    """family -> (its tiny tower, that tower over the buckets of MAX_ITEMS and EXACT_ITEMS), made at the first ask:
    the tests calling it with ``output_hidden_states=True`` share its one trace."""
    made = {}

    def get(family):
        if family not in made:
            tower = tiny_tower(family)
            made[family] = tower, compile_tile_tower(
                tower, max_items=MAX_ITEMS, exact_items=EXACT_ITEMS, compiler="eager"
            )
        return made[family]

    return get


MECHANISMS = ("gemma3", "llava", "idefics3", "internvl", "got_ocr2")
"""One family per kind of tile tower (SigLIP, CLIP, a patch mask, InternViT, GOT-OCR2's windowed SAM): the served
families outside the thorough profile."""


@pytest.mark.parametrize("family", SERVED if THOROUGH else [family for family in SERVED if family in MECHANISMS])
def test_tower_is_eager_equal_and_served_by_bucket_graphs(bucketed, family):
    """Every N of CALLS matches the stock tower (last_hidden_state, pooler_output, every hidden state) and is served
    by graphs: one replay per call, two for the call past max_items."""
    tower, compiled = bucketed(family)
    assert tile_buckets(MAX_ITEMS, EXACT_ITEMS) == (1, 2, 3, 4, 5, 7, 8, 10)
    with torch.no_grad():
        compiled(_pixels(3), output_hidden_states=True)  # the trace
        with counters.expect(replays=len(CALLS) + 1):
            for tiles in CALLS:
                pixels = _pixels(tiles, seed=tiles)
                served = compiled(pixels, output_hidden_states=True)
                _assert_outputs_equal(served, tower(pixels, output_hidden_states=True))
    assert compiled.split_calls == 1 and compiled.stock_calls == 0


def test_every_tile_count_up_to_max_items_is_served_by_its_own_bucket():
    """N = 1..max_items each replay the graph of exactly N tiles (one tile included: the trace's guards keep it),
    eager-equal, on the tower whose attention took a mask under tracing (Idefics3's SigLIP)."""
    tower = tiny_tower("idefics3")
    compiled = compile_tile_tower(tower, max_items=6, exact_items=6, compiler="eager")
    with torch.no_grad():
        compiled(_pixels(3))  # the trace
        with counters.expect(replays=6):  # one replay per call, N = 1..6
            for tiles in range(1, 7):
                pixels = _pixels(tiles, seed=tiles)
                _assert_outputs_equal(compiled(pixels), tower(pixels))
    (runtime,) = compiled.runtimes
    assert {bucket.shape.budget: bucket.stats.hits for bucket in runtime.buckets} == {1: 1, 2: 1, 3: 2, 4: 1, 5: 1, 6: 1}


def test_an_all_true_patch_mask_is_served_by_the_mask_free_trace():
    """SmolVLM passes a patch mask for every tile; one that masks nothing runs the trace of the call without it."""
    tower = tiny_tower("smolvlm")
    compiled = compile_tile_tower(tower, max_items=4, compiler="eager")
    pixels, mask = _pixels(3), torch.ones(3, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        _assert_outputs_equal(compiled(pixels, patch_attention_mask=mask), tower(pixels, patch_attention_mask=mask))
        with counters.expect(replays=1):
            compiled(pixels)
    assert list(compiled.compiled) == [(False, None)]


def test_selected_hidden_state_is_served():
    """LLaVA's vision_feature_layer reaches the tower as output_hidden_states=[-2]."""
    tower = tiny_tower("llava")
    compiled = compile_tile_tower(tower, max_items=4, compiler="eager")
    with torch.no_grad():
        pixels = _pixels(3)
        got, want = compiled(pixels, output_hidden_states=[-2]), tower(pixels, output_hidden_states=[-2])
        _assert_outputs_equal(got, want)
        assert [h is None for h in got.hidden_states] == [h is None for h in want.hidden_states]


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_padding_tiles_with_patch_mask(family):
    """Idefics3/SmolVLM batches: an all-zero padding image, and images smaller than the tile (a partial mask)."""
    tower = tiny_tower(family)
    compiled = compile_tile_tower(tower, max_items=8, compiler="eager")
    pixels = _pixels(5)
    pixels[3] = 0
    mask = torch.ones(5, 4, 4, dtype=torch.bool)
    mask[1, 2:, :] = False
    mask[4, :, 3:] = False
    pixels[1, :, 16:, :] = 0
    # the patch convolution rewritten in both copies of the trace
    with torch.no_grad(), counters.expect(traces=1, nodes_rewritten=2, buckets_built=8, replays=1):
        got = compiled(pixels, patch_attention_mask=mask)
    _assert_outputs_equal(got, tower(pixels, patch_attention_mask=mask))


def test_nan_tile_leaves_the_others_bit_identical(bucketed):
    """Six tiles in the bucket of seven (one padding tile), on the trace the eager comparison made."""
    _, compiled = bucketed("internvl")
    pixels = _pixels(6)
    with torch.no_grad():
        clean = compiled(pixels, output_hidden_states=True).last_hidden_state
        pixels[2, 0, 5, 5] = float("nan")
        pixels[4, 1, 0, 0] = float("inf")
        poisoned = compiled(pixels, output_hidden_states=True).last_hidden_state
    keep = [0, 1, 3, 5]
    assert torch.equal(clean[keep], poisoned[keep])
    assert poisoned[2].isnan().any()


def test_bad_input_is_refused_in_the_users_names():
    compiled = compile_tile_tower(tiny_tower("gemma3"), max_items=4, compiler="eager")
    with pytest.raises(ValueError, match=r"pixel_values must be \[tiles, 3, 32, 32\]"), torch.no_grad():
        compiled(torch.randn(2, 3, 64, 64))
    with pytest.raises(ValueError, match="token_budgets is not a tile-tower option"):
        compile_tile_tower(tiny_tower("gemma3"), token_budgets=(4,))


def test_grad_calls_run_the_stock_tower():
    tower = tiny_tower("gemma3")
    compiled = compile_tile_tower(tower, max_items=4, compiler="eager")
    compiled(_pixels(2)).last_hidden_state.sum().backward()
    assert compiled.stock_calls == 1 and next(tower.parameters()).grad is not None
    assert compiled.state_dict().keys() == tower.state_dict().keys()


# -- whole VLMs --------------------------------------------------------------------------------------------------
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
TEXT_VOCAB = dict(vocab_size=128, head_dim=16)
IMAGE_TOKEN = 100
PINPOINTS = [[64, 64], [64, 128], [128, 64], [128, 128]]
VLMS = {
    # family: (model class, tower path, top-level config, image processor class and its arguments, photograph)
    "internvl": (
        "InternVLForConditionalGeneration", "model.vision_tower", {},
        ("GotOcr2ImageProcessorPil", dict(crop_to_patches=True, size={"height": 64, "width": 64}, max_patches=6)),
        "astronaut",
    ),
    "smolvlm": (
        "SmolVLMForConditionalGeneration", "model.vision_model", {"scale_factor": 2},
        ("SmolVLMImageProcessorPil", dict(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})),
        "chelsea",
    ),
    "gemma3": (
        "Gemma3ForConditionalGeneration", "model.vision_tower", {"mm_tokens_per_image": 4},
        ("Gemma3ImageProcessorPil", dict(size={"height": 64, "width": 64}, do_pan_and_scan=True,
                                         pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=4,
                                         pan_and_scan_min_ratio_to_activate=1.2)),
        "chelsea",
    ),
    "llava_onevision": (
        "LlavaOnevisionForConditionalGeneration", "model.vision_tower", {"image_grid_pinpoints": PINPOINTS},
        ("LlavaOnevisionImageProcessorPil", dict(size={"height": 64, "width": 64},
                                                  crop_size={"height": 64, "width": 64},
                                                  image_grid_pinpoints=PINPOINTS)),
        "astronaut",
    ),
}  # fmt: skip
"""Each family's own image processor (its PIL backend: torchvision is not installed here) at a tile of 64 px."""


def tiny_vlm(family: str):
    model_class, _, top, _, _ = VLMS[family]
    config = transformers.CONFIG_MAPPING[family]()
    _set(config.text_config, {**TEXT, **TEXT_VOCAB})
    _set(config.vision_config, {**TINY, "image_size": 64, "patch_size": 16})
    _set(config, {"image_token_id": IMAGE_TOKEN, "image_token_index": IMAGE_TOKEN, **top})
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def _inputs(family: str, model) -> dict:
    """The processor's tensors for a real photograph, and a prompt with as many image tokens as the stock model
    makes image features (so the prompt fits whatever tiling the processor chose)."""
    skimage_data = pytest.importorskip("skimage.data")
    _, _, _, (processor_class, arguments), photo = VLMS[family]
    processor = getattr(transformers, processor_class)(**arguments)
    inputs = {
        name: value
        for name, value in processor(images=getattr(skimage_data, photo)(), return_tensors="pt").items()
        if name not in ("num_patches", "num_crops")
    }
    with torch.no_grad():
        features = model.model.get_image_features(**inputs).pooler_output
    features = features if isinstance(features, (list, tuple)) else [features]
    rows = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features)
    input_ids = torch.tensor([[1] + [IMAGE_TOKEN] * rows + [5, 6, 7]])
    return {**inputs, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


@pytest.mark.parametrize("family", sorted(VLMS) if THOROUGH else ["internvl"])
def test_vlm_logits_and_greedy_tokens_with_the_tile_tower(family):
    """The model with its tower replaced gives the stock logits and greedy tokens, on the family's processor output
    for a photograph, its state dict keys unchanged and every tower call served by bucket graphs."""
    model = tiny_vlm(family)
    inputs = _inputs(family, model)
    assert inputs["pixel_values"].reshape(-1, 3, 64, 64).shape[0] > 1, "the processor should tile the photograph"
    keys = list(model.state_dict())
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    path = VLMS[family][1]
    owner_path, _, attribute = path.rpartition(".")
    assert find_vision_tower(model) == (model.get_submodule(owner_path), attribute), "compile_vlm finds the tower"
    compile_vlm(model, compiler="eager", max_items=8)
    tower = model.get_submodule(path)
    with torch.no_grad():
        served = model(**inputs).logits
        served_tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert ((served - logits).abs().max() / logits.abs().max()) <= 1e-5
    assert torch.equal(served_tokens, tokens)
    assert list(model.state_dict()) == keys
    assert tower.stock_calls == 0 and sum(runtime.hits for runtime in tower.runtimes) >= 2


@pytest.fixture(scope="module")
def map_head():
    """SigLIP with its MAP head (``nn.MultiheadAttention`` pooling), buckets 1, 2, 3, first called with one tile.
    The head's key projection is a linear of a transposed ``[L, N, E]`` view, whose contiguity check guards
    N != 1 in the trace dynamic in N: that trace drops the bucket of one tile, so the first call also traces one
    tile statically. Counted: two traces; buckets 2 and 3, then 1; one replay for each trace's call; the patch
    convolution rewritten in both copies of each trace."""
    tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(vision_use_head=True, **TINY)).eval()
    compiled = compile_tile_tower(tower, max_items=3, exact_items=3, compiler="eager")
    pixels = _pixels(1, seed=1)
    with torch.no_grad(), counters.expect(traces=2, nodes_rewritten=4, buckets_dropped=1, buckets_built=3, replays=2):
        _assert_outputs_equal(compiled(pixels), tower(pixels))
    return tower, compiled


def _hits(compiled) -> dict[int, int]:
    """Bucket budget -> calls it served, over every runtime of a tile tower (each budget is in one of them)."""
    return {bucket.shape.budget: bucket.stats.hits for runtime in compiled.runtimes for bucket in runtime.buckets}


def test_one_tile_is_served_by_a_bucket_of_one_where_the_dynamic_trace_excludes_it(map_head):
    """N = 1, 2, 3 and 7 (3 + 3 + 1) match the stock tower; one tile, alone or as the last chunk of a split call,
    replays the one-tile graph, never the bucket of 2. The dropped bucket is listed with its guard and op."""
    tower, compiled = map_head
    dynamic, one_tile = compiled.runtimes
    assert [bucket.shape.budget for bucket in dynamic.buckets] == [2, 3]
    assert [bucket.shape.budget for bucket in one_tile.buckets] == [1]
    before = _hits(compiled)
    with torch.no_grad(), counters.expect(replays=6):  # N = 1, 2, 3: one each; N = 7: three
        for tiles in (1, 2, 3, 7):
            pixels = _pixels(tiles, seed=tiles)
            _assert_outputs_equal(compiled(pixels), tower(pixels))
    after = _hits(compiled)
    assert {budget: after[budget] - before[budget] for budget in after} == {1: 2, 2: 1, 3: 3}
    table = compiled.stats_table()
    assert "budget 1 dropped: the trace's guard Ne(N, 1) on the tile count N fails there" in table
    assert "multi_head_attention_forward" in table and "one tile: its own static graph" in table


def test_exact_size_runs_where_the_guards_hold_and_pads_where_they_do_not(map_head):
    """call_choice="exact_size": N = 2 and 3 run the dynamic compiled code at their own sizes, one tile the
    one-tile graph's. The dynamic trace alone, called with one tile, breaks its guard N != 1 and pads to the bucket
    of 2. All equal the stock tower."""
    tower, compiled = map_head
    dynamic, one_tile = compiled.runtimes
    (traced,) = compiled.compiled.values()
    before = dynamic.choices.copy(), one_tile.choices.copy()
    try:
        dynamic.call_choice = one_tile.call_choice = "exact_size"
        with torch.no_grad(), counters.expect(replays=1):  # the padded call
            for tiles in (3, 1, 2):
                pixels = _pixels(tiles, seed=tiles)
                _assert_outputs_equal(compiled(pixels), tower(pixels))
            pixels = _pixels(1, seed=9)
            (hidden, pooled) = traced.dynamic(pixels)
            want = tower(pixels)
            _assert_outputs_equal(SimpleNamespace(last_hidden_state=hidden, pooler_output=pooled), want)
    finally:
        dynamic.call_choice = one_tile.call_choice = "smallest_bucket"
    assert dynamic.choices - before[0] == {"compiled code at the exact size": 2, "padded to the smallest bucket": 1}
    assert one_tile.choices - before[1] == {"compiled code at the exact size": 1}
