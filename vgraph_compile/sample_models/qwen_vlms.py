"""Whole Qwen VLMs (random weights, no download) and the requests they are fed: real photographs, a synthetic
video clip, and prompts laid out the way transformers' processors lay them out.

Pixels come from transformers' own ``Qwen2VLImageProcessor`` (the one Qwen2-VL, Qwen2.5-VL and Qwen3-VL use),
built from the model config's patch and merge sizes. The photographs are scikit-image's sample data (astronaut,
coffee, chelsea, rocket: real photos shipped inside that package). The prompt token ids are built here, from the
config's image/video/vision-start/vision-end token ids, with the processors' expansion rule (``t*h*w / merge^2``
placeholder tokens per item; Qwen3-VL: one ``<t seconds>`` stamp and vision-start/end pair per temporal patch):
transformers' ``*Processor`` classes cannot be built without torchvision (their video-processor slot is type
checked against a torchvision class), and the text vocabulary is random anyway. A video is its frames run through
the same image processor, each pair of frames made one temporal patch (the video processor's layout: rows
``[C, T, P, P]`` in the image's merge-block order).
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from vgraph_compile.sample_models.qwen_towers import MERGER_WIDTH, REAL_SIZES, TOY_SIZES

__all__ = ["VLM_FAMILIES", "Item", "Request", "qwen_vlm", "image_processor", "photos", "video_clip", "model_inputs", "resized"]

TINY_IDS = dict(pad=500, vision_start_token_id=501, vision_end_token_id=502, image_token_id=503, video_token_id=504)
"""Special token ids of the tiny models (vocabulary 512); the real sizes keep Qwen's (151643, 151652-151656)."""

_TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_QWEN2_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    rope_theta=1e6,
)
"""Qwen2-VL-7B's and Qwen2.5-VL-7B's language model (the same Qwen2-7B sizes)."""


@dataclass(frozen=True)
class Family:
    """A VLM class of the tower family (the module is the tower's, ``REAL_SIZES``)."""

    model_class: str
    config_class: str
    text: dict
    """The released 7B/8B language model's config fields."""
    mrope_section: list[int]
    mrope_interleaved: bool = False


TINY_MROPE_SECTION = [2, 3, 3]
"""The multimodal rotary sections of the tiny models' 16-dim heads (every family)."""

VLM_FAMILIES = {
    "qwen2-vl": Family("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", _QWEN2_7B_TEXT, [16, 24, 24]),
    "qwen2.5-vl": Family("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", _QWEN2_7B_TEXT, [16, 24, 24]),
    "qwen3-vl": Family(
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLConfig",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            rope_theta=5e6,
        ),
        [24, 20, 20],
        mrope_interleaved=True,
    ),
}
"""Qwen2-VL-7B, Qwen2.5-VL-7B and Qwen3-VL-8B: the language model sizes (the towers are ``REAL_SIZES``)."""


def qwen_vlm(family: str, tiny: bool = True, device="cpu", dtype=torch.float32, seed: int = 0):
    """``*ForConditionalGeneration`` with random weights in eval mode, sdpa attention; ``tiny``: 2 text layers of
    width 64, a 2-block tower of width 32, vocabulary 512 (``TINY_IDS``); else the released sizes."""
    spec = VLM_FAMILIES[family]
    module = importlib.import_module(REAL_SIZES[family][0])
    text = dict(_TINY_TEXT, vocab_size=512) if tiny else dict(spec.text)
    vision = {  # the tower's merger feeds the language model: its output width is the text hidden size
        **REAL_SIZES[family][3],
        **(TOY_SIZES[family] if tiny else {}),
        MERGER_WIDTH[family]: text["hidden_size"],
    }
    rope = dict(
        rope_type="default",
        rope_theta=text.pop("rope_theta", 1e4),
        mrope_section=TINY_MROPE_SECTION if tiny else spec.mrope_section,
    )
    if spec.mrope_interleaved:
        rope["mrope_interleaved"] = True
    ids = {name: value for name, value in TINY_IDS.items() if name != "pad"} if tiny else {}
    torch.manual_seed(seed)
    config = getattr(module, spec.config_class)(
        text_config=dict(text, rope_parameters=rope), vision_config=vision, **ids
    )
    with torch.device(device):
        model = getattr(module, spec.model_class)._from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.pad_token_id = pad_token_id(model.config)
    return model.eval()


def pad_token_id(config) -> int:
    return TINY_IDS["pad"] if config.image_token_id == TINY_IDS["image_token_id"] else 151643


def image_processor(config, max_patches: int | None = None):
    """transformers' ``Qwen2VLImageProcessor`` with the tower's patch, temporal patch and merge sizes (Qwen3-VL:
    mean and std 0.5, as its processor config); ``max_patches`` caps each image's patches (default: the
    processor's own cap, 1280 merged tokens)."""
    from transformers.utils import logging as hf_logging

    vision = config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    options = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if config.model_type.startswith("qwen3") else {}
    if max_patches is not None:
        options["size"] = {"shortest_edge": (patch * merge) ** 2, "longest_edge": max_patches * patch * patch}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # without torchvision: "falling back to the PIL backend"
    try:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(
            patch_size=patch, temporal_patch_size=vision.temporal_patch_size, merge_size=merge, **options
        )
    finally:
        hf_logging.set_verbosity(verbosity)


PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def photos() -> dict[str, np.ndarray]:
    """Real photographs shipped with scikit-image, ``[H, W, 3]`` uint8 (512x512, 400x600, 300x451, 427x640)."""
    try:
        import skimage.data
    except ImportError as error:
        raise ImportError("the sample photographs come with scikit-image: pip install scikit-image") from error
    return {name: getattr(skimage.data, name)() for name in PHOTOS}


def video_clip(photo: np.ndarray, frames: int = 8, size: tuple[int, int] = (224, 224), step: int = 24) -> np.ndarray:
    """A camera pan: ``frames`` crops of ``size`` moving ``step`` pixels right and down per frame, ``[F, H, W, 3]``."""
    height, width = size
    reach = max(0, min(photo.shape[0] - height, photo.shape[1] - width))
    return np.stack([photo[o : o + height, o : o + width] for o in (min(i * step, reach) for i in range(frames))])


@dataclass(frozen=True)
class Item:
    kind: str
    """"image" or "video"."""
    pixels: np.ndarray
    """``[H, W, 3]`` (image) or ``[F, H, W, 3]`` (video, F a multiple of the temporal patch)."""
    resize_to: tuple[int, int] | None = None
    """Resize the photo to (height, width) first (to vary resolutions); None keeps it."""


@dataclass(frozen=True)
class Request:
    """One prompt: text token counts between the items (``len(items) + 1`` runs)."""

    items: tuple[Item, ...]
    text_tokens: tuple[int, ...]
    seed: int = 0


def resized(pixels: np.ndarray, shape: tuple[int, int] | None) -> np.ndarray:
    """``pixels`` resized to (height, width) with bicubic filtering; None keeps them."""
    if shape is None:
        return pixels
    from PIL import Image

    return np.asarray(Image.fromarray(pixels).resize((shape[1], shape[0]), Image.Resampling.BICUBIC))


def _pixels(processor, frames: list[np.ndarray]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One frame: the processor's own rows. Several: each frame's rows (which the processor repeats over the
    temporal patch), regrouped so one row holds ``temporal_patch_size`` consecutive frames."""
    out = processor(images=frames, return_tensors="pt")
    rows, grid = out["pixel_values"], out["image_grid_thw"]
    _, h, w = grid[0].tolist()
    if len(frames) == 1:
        return rows, (1, h, w)
    temporal, patch = processor.temporal_patch_size, processor.patch_size
    per_frame = rows.view(len(frames), h * w, -1, temporal, patch, patch)[:, :, :, 0]
    grouped = per_frame.view(len(frames) // temporal, temporal, h * w, -1, patch, patch).permute(0, 2, 3, 1, 4, 5)
    return grouped.reshape(len(frames) // temporal * h * w, -1), (len(frames) // temporal, h, w)


def model_inputs(model, requests: list[Request], processor=None, device=None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for a batch of prompts (left-padded), as a processor call would give them:
    ``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``pixel_values`` / ``image_grid_thw``,
    ``pixel_values_videos`` / ``video_grid_thw`` (and Qwen2.5-VL's ``second_per_grid_ts``)."""
    config = model.config
    processor = processor or image_processor(config)
    merge = config.vision_config.spatial_merge_size
    temporal = config.vision_config.temporal_patch_size
    qwen3 = config.model_type.startswith("qwen3")
    pixels: dict[str, list] = {"image": [], "video": []}
    grids: dict[str, list] = {"image": [], "video": []}
    sequences, types = [], []
    vocab = min(config.get_text_config().vocab_size, TINY_IDS["pad"])
    for request in requests:
        rng = random.Random(request.seed)
        ids: list[int] = []
        kinds: list[int] = []

        def text(count: int) -> None:
            ids.extend(rng.randrange(vocab) for _ in range(count))
            kinds.extend([0] * count)

        def vision(token: int, kind: int, count: int) -> None:
            ids.extend([config.vision_start_token_id, *[token] * count, config.vision_end_token_id])
            kinds.extend([0, *[kind] * count, 0])

        text(request.text_tokens[0])
        for item, after in zip(request.items, request.text_tokens[1:]):
            frames = [resized(f, item.resize_to) for f in (item.pixels if item.kind == "video" else [item.pixels])]
            rows, (t, h, w) = _pixels(processor, frames)
            pixels[item.kind].append(rows)
            grids[item.kind].append((t, h, w))
            if item.kind == "image":
                vision(config.image_token_id, 1, t * h * w // merge**2)
            elif qwen3:  # "<1.0 seconds>" before each temporal patch's frame tokens
                for _ in range(t):
                    text(5)
                    vision(config.video_token_id, 2, h * w // merge**2)
            else:
                vision(config.video_token_id, 2, t * h * w // merge**2)
            text(after)
        sequences.append(ids)
        types.append(kinds)
    length = max(map(len, sequences))
    pad = pad_token_id(config)
    out = {
        "input_ids": torch.tensor([[pad] * (length - len(s)) + s for s in sequences]),
        "attention_mask": torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in sequences]),
        "mm_token_type_ids": torch.tensor([[0] * (length - len(k)) + k for k in types]),
    }
    for kind, (values, grid) in (
        ("image", ("pixel_values", "image_grid_thw")),
        ("video", ("pixel_values_videos", "video_grid_thw")),
    ):
        if pixels[kind]:
            out[values] = torch.cat(pixels[kind]).to(model.dtype)
            out[grid] = torch.tensor(grids[kind])
    if pixels["video"] and config.model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.full((len(pixels["video"]),), temporal / 2.0)  # 2 frames per second
    return {name: value.to(device or model.device) for name, value in out.items()}
