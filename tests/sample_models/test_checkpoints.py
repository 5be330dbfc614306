"""Saved model directories: what ``from_pretrained`` loads back is the model and a processor whose tokenizer maps
every id to a word of its own, the model's special tokens at its config's ids."""

import numpy as np
import pytest
import torch
from PIL import Image

from vgraph_compile.sample_models.checkpoints import answer_ids, save_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    directory = save_checkpoint("paddleocr_vl", tmp_path_factory.mktemp("paddleocr_vl"))
    return AutoModelForImageTextToText.from_pretrained(directory).eval(), AutoProcessor.from_pretrained(directory)


def test_words_spell_their_ids_and_special_tokens_sit_at_the_configs_ids(saved):
    model, processor = saved
    tokenizer, config = processor.tokenizer, model.config
    assert len(tokenizer) == config.text_config.vocab_size
    assert tokenizer.image_token_id == config.image_token_id
    assert tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]) == [
        config.vision_start_token_id, config.vision_end_token_id,
    ]  # fmt: skip
    ids = [0, 7, 4095, config.text_config.vocab_size - 10]
    assert answer_ids(tokenizer.decode(ids)) == ids
    assert tokenizer("t7 t4095")["input_ids"] == [7, 4095]


def test_a_chat_turn_with_an_image_is_what_the_model_takes(saved):
    """The chat template and processor lay out one image as vision start, one image token per merged patch,
    vision end; the model generates from it, and the tiny text weights make the answer depend on the image."""
    model, processor = saved
    answers = []
    for seed in range(2):
        pixels = np.random.default_rng(seed).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
        content = [{"type": "image", "image": Image.fromarray(pixels)}, {"type": "text", "text": "t5"}]
        inputs = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt",
        )  # fmt: skip
        ids = inputs["input_ids"][0].tolist()
        merged = int(inputs["image_grid_thw"].prod()) // processor.image_processor.merge_size**2
        start = ids.index(model.config.vision_start_token_id)
        assert ids[start + 1 : start + 2 + merged] == [model.config.image_token_id] * merged + [
            model.config.vision_end_token_id
        ]
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        answers.append(out[0, len(ids) :].tolist())
    assert answers[0] != answers[1]
