"""The tiny Qwen VLMs and their inputs: the tower feeds the language model at its width, and ``model_inputs`` gives
what a processor call gives (one vision token per merged row, left padding, video rows grouped per temporal
patch), so the model runs on them. (Served by ``compile_vlm``: ``tests/hf/test_vlm.py``.)"""

import numpy as np
import pytest
import torch

from vgraph_compile.sample_models.qwen_vlms import (
    TINY_IDS,
    Item,
    Request,
    image_processor,
    model_inputs,
    qwen_vlm,
    video_clip,
)


@pytest.fixture(scope="module")
def model():
    return qwen_vlm("qwen2-vl", tiny=True)


def _photo(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_the_towers_merger_width_is_the_text_width(model):
    assert model.config.vision_config.hidden_size == model.config.get_text_config().hidden_size


def test_a_video_clip_pans_over_the_photo():
    photo = _photo(40, 50)
    clip = video_clip(photo, frames=4, size=(32, 32), step=3)
    assert clip.shape == (4, 32, 32, 3)
    assert np.array_equal(clip[0], photo[:32, :32]) and np.array_equal(clip[2], photo[6:38, 6:38])
    assert np.array_equal(clip[3], photo[8:40, 8:40])  # the pan stops at the photo's edge


def test_inputs_hold_one_vision_token_per_merged_row_left_padded(model):
    processor = image_processor(model.config, max_patches=64)
    requests = [
        Request((Item("image", _photo(56, 84)),), (3, 2)),
        Request((Item("video", video_clip(_photo(64, 64), frames=2, size=(56, 56))),), (1, 1), seed=1),
    ]
    inputs = model_inputs(model, requests, processor)
    merge = model.config.vision_config.spatial_merge_size
    (t, h, w), (vt, vh, vw) = inputs["image_grid_thw"][0].tolist(), inputs["video_grid_thw"][0].tolist()
    assert inputs["pixel_values"].shape[0] == t * h * w and inputs["pixel_values_videos"].shape[0] == vt * vh * vw
    ids = inputs["input_ids"]
    assert (ids[0] == model.config.image_token_id).sum() == t * h * w // merge**2
    assert (ids[1] == model.config.video_token_id).sum() == vt * vh * vw // merge**2
    padding = ids[1] == TINY_IDS["pad"]
    assert torch.equal(inputs["attention_mask"][1], (~padding).long())
    assert padding.sum() > 0 and not padding[padding.sum() :].any()  # left padding
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == ids.shape and logits.isfinite().all()
