"""compile_vlm on tiny random VLMs: the same logits (fp32, rel <= 1e-5) and greedy tokens as the stock model, on
inputs made from real photographs (scikit-image's samples). Qwen2-VL, Qwen2.5-VL and Qwen3-VL: by transformers'
Qwen2-VL image processor, with a video clip panning over one photograph; images, a video, both in one prompt, two
prompts in one batch. Six families vgraph has no code for (cohere_compass, ernie4_5_vl_moe, exaone4_5,
dots3_note, glm4v, paddleocr_vl): built from their own config classes, pixels from each family's own image
processor (its PIL backend, no torchvision), two photographs in one prompt. The stock numbers are taken from the
same model before compile_vlm replaces its tower."""

import pytest
import torch

from tests.helpers import THOROUGH
from vgraph_compile.counters import counters
from vgraph_compile.hf import CompiledBlockTower, CompiledVisionTower, compile_vlm, routed_attention
from vgraph_compile.hf.vlm import find_vision_tower
from vgraph_compile.sample_models import vision_utils_vlms
from vgraph_compile.sample_models.qwen_vlms import (
    Item,
    Request,
    resized,
    image_processor,
    model_inputs,
    photos,
    qwen_vlm,
    video_clip,
)

pytest.importorskip("skimage", reason="the sample photographs come with scikit-image")

QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
OTHER_FAMILIES = ["cohere_compass", "ernie4_5_vl_moe", "exaone4_5", "dots3_note", "glm4v", "paddleocr_vl"]


def _requests():
    photo = photos()
    clip = video_clip(photo["astronaut"], frames=4, size=(112, 112), step=16)
    return {
        # prompt 1: text, an image, text, a video, text; prompt 2: two images at other resolutions
        "batch of 2, mixed": [
            Request((Item("image", photo["coffee"]), Item("video", clip)), (7, 3, 2), seed=1),
            Request((Item("image", photo["chelsea"], (150, 220)), Item("image", photo["rocket"])), (4, 2, 9), seed=2),
        ],
        "video": [Request((Item("video", clip),), (5, 4), seed=3)],
    }


def _qwen_cases(family):
    model = qwen_vlm(family)
    processor = image_processor(model.config, max_patches=128)
    return model, {case: model_inputs(model, requests, processor) for case, requests in _requests().items()}


def _family_cases(family):
    """Two photographs resized small (the processor rounds their sides to merge units), in one prompt."""
    model = vision_utils_vlms.build_vlm(family)
    processor = vision_utils_vlms.image_processor(family, model)
    photo = photos()
    images = [resized(photo["coffee"], (120, 180)), resized(photo["chelsea"], (150, 100))]
    return model, {"two images": vision_utils_vlms.image_inputs(model, processor, images)}


@pytest.fixture(scope="module", params=QWEN + OTHER_FAMILIES if THOROUGH else ["qwen3-vl", "paddleocr_vl"])
def served(request):
    """(family, model after compile_vlm, {case: (inputs, stock logits, stock greedy tokens)})."""
    model, inputs = (_qwen_cases if request.param in QWEN else _family_cases)(request.param)
    cases = {}
    with torch.no_grad():
        for case, case_inputs in inputs.items():
            stock = model(**case_inputs).logits, model.generate(**case_inputs, max_new_tokens=4, do_sample=False)
            cases[case] = (case_inputs, *stock)
    keys = list(model.state_dict())
    compile_vlm(model, token_budgets=[64, 256], max_items=4, compiler="eager", attention_backend="sdpa")
    assert list(model.state_dict()) == keys
    return request.param, model, cases


def _tower(model):
    owner, attribute = find_vision_tower(model)
    return getattr(owner, attribute)


def test_same_logits_and_greedy_tokens_as_stock(served):
    family, model, cases = served
    tower = _tower(model)
    assert isinstance(tower, CompiledVisionTower)
    for case, (inputs, logits, tokens) in cases.items():
        before = counters.snapshot()["replays"]
        with torch.no_grad():
            mine = model(**inputs).logits
            generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert counters.snapshot()["replays"] > before and tower.stock_calls == 0, case
        torch.testing.assert_close(mine, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())
        assert torch.equal(generated, tokens), case


def test_features_keep_the_towers_output_class(served):
    """get_image_features / get_video_features: the tower's own output class, per-item features equal to the stock
    tower's (Qwen3-VL: deepstack features too). The Qwen models: the other families' feature methods project the
    tower's output to the text width."""
    family, model, cases = served
    if family not in QWEN:
        pytest.skip("get_image_features returns projected features in this family")
    inputs = cases["batch of 2, mixed"][0]
    tower = model.model.visual.tower
    with torch.no_grad():
        for method, pixels, grid in (
            ("get_image_features", "pixel_values", "image_grid_thw"),
            ("get_video_features", "pixel_values_videos", "video_grid_thw"),
        ):
            out = getattr(model, method)(inputs[pixels], inputs[grid])
            stock = tower(inputs[pixels], grid_thw=inputs[grid])
            assert type(out) is type(stock)
            sizes = (inputs[grid].prod(-1) // 4).tolist()
            assert [f.shape[0] for f in out.pooler_output] == sizes
            torch.testing.assert_close(torch.cat(out.pooler_output), stock.pooler_output, rtol=1e-5, atol=1e-6)
            deepstack = getattr(out, "deepstack_features", None) or ()  # per level, split per item like pooler_output
            assert len(deepstack) == len(stock.get("deepstack_features", ()))
            for mine, theirs in zip(deepstack, stock.get("deepstack_features", ())):
                torch.testing.assert_close(torch.cat(mine), theirs, rtol=1e-5, atol=1e-6)


def test_grad_enabled_forward_runs_the_stock_tower(served):
    family, model, cases = served
    case = next(iter(cases))
    inputs = cases[case][0]
    tower = _tower(model)
    before = tower.stock_calls
    with counters.expect():
        logits = model(**inputs).logits
    modalities = sum(key in inputs for key in ("pixel_values", "pixel_values_videos"))  # one tower call each
    assert tower.stock_calls == before + modalities and logits.grad_fn is not None
    torch.testing.assert_close(logits.detach(), cases[case][1], rtol=1e-5, atol=1e-5 * logits.abs().max().item())


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="compile_vlm found no vision tower in Linear"):
        compile_vlm(torch.nn.Linear(2, 2))


def test_tower_found_by_the_models_vision_config_whatever_its_forward_takes():
    """MiniCPM-V 4.6: its tower takes ``target_sizes``, neither a grid nor fixed tiles; ``compile_vlm`` finds it as
    the model of the VLM's ``vision_config`` and serves it by block graphs, equal to the stock tower."""
    from transformers.models.minicpmv4_6 import configuration_minicpmv4_6, modeling_minicpmv4_6

    from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

    vision = build_tower("minicpmv4_6", tiny=True).config.to_dict()
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=600)  # fmt: skip
    config = configuration_minicpmv4_6.MiniCPMV4_6Config(vision_config=vision, text_config=text)
    model = modeling_minicpmv4_6.MiniCPMV4_6ForConditionalGeneration(config).eval()
    tower = model.model.vision_tower
    compile_vlm(model, token_budgets=[256], compiler="eager", attention_backend="sdpa")
    served = model.model.vision_tower
    assert isinstance(served, CompiledBlockTower) and served.tower is tower
    args, kwargs = tower_call("minicpmv4_6", tower, [(1, 8, 12)])
    with torch.no_grad():
        out = served(*args, **kwargs)
        with routed_attention(tower):
            ref = tower(*args, **kwargs)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
