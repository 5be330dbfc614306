"""The tiny fixed-tile VLM (InternVL) and its inputs: InternVL's processor cuts each image into tiles (a thumbnail
added to several), the prompt holds the image tokens of every tile, and the model runs on them. (Served by
``compile_vlm``: ``tests/hf/test_vlm.py``.)"""

import numpy as np
import torch

from vgraph_compile.sample_models.qwen_vlms import Item, Request
from vgraph_compile.sample_models.tile_vlms import internvl, tile_inputs, tile_processor


def test_the_prompt_holds_four_image_tokens_per_tile_and_the_model_runs_on_it():
    model = internvl(tiny=True)
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 256, (64, 128, 3), dtype=np.uint8)  # two tiles and a thumbnail
    square = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)  # one tile
    request = Request((Item("image", wide), Item("image", square)), (3, 2, 1))
    inputs = tile_inputs(model, request, tile_processor(model, max_tiles=4))
    assert inputs["pixel_values"].shape == (4, 3, 64, 64)
    ids = inputs["input_ids"][0]
    assert (ids == model.config.image_token_id).sum() == 4 * 4 and ids.shape[0] == 3 + 2 + 1 + 16
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[1] == ids.shape[0] and logits.isfinite().all()
