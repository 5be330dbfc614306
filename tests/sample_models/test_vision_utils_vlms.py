"""A vision_utils family's tiny VLM and its inputs: the family's own generation class at one text layer of width
128, and a prompt from the family's own image processor that the model runs on.
GLM-4.1V stands for the families (each served by ``compile_vlm``: ``tests/hf/test_vlm.py``)."""

import numpy as np
import pytest
import torch

from vgraph_compile.sample_models.vision_utils_vlms import (
    TINY_TEXT,
    build_vlm,
    image_inputs,
    image_processor,
    vlm_class,
)


@pytest.fixture(scope="module")
def model():
    return build_vlm("glm4v")


def test_a_tiny_vlm_is_the_familys_generation_class_and_runs_on_its_processors_prompt(model):
    """The model runs only where the tower's output width is the text width and each image has its tokens."""
    assert type(model) is vlm_class("glm4v") and type(model).__name__ == "Glm4vForConditionalGeneration"
    text = model.config.get_text_config()
    assert (text.num_hidden_layers, text.hidden_size) == (TINY_TEXT["num_hidden_layers"], TINY_TEXT["hidden_size"])
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8), rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)]
    inputs = image_inputs(model, image_processor("glm4v", model), images, text_tokens=2)
    merged = (inputs["image_grid_thw"].prod(-1) // 4).sum()
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == merged
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[1] == inputs["input_ids"].shape[1] and logits.isfinite().all()


def test_a_family_without_a_pil_processor_is_refused_with_what_it_needs(model):
    with pytest.raises(ValueError, match="registers no PIL image processor .*: it needs torchvision"):
        image_processor("no_such_family", model)
