"""Local model directories of random-weight VLMs, laid out as a user's checkpoint: the model's config and weights
and its processor (image processor, tokenizer, chat template; a video processor where the processor class has one),
written by ``save_pretrained``, so ``from_pretrained``, ``transformers serve`` and ``vgraph serve`` load them with no
hub.

Models: ``qwen2.5-vl`` (and the other Qwen VLMs of ``qwen_vlms``), ``internvl3-1b`` (``tile_vlms``), or a
``vision_utils`` family whose processor takes no video processor (``paddleocr_vl``: ``family_vlms``); tiny, or at
released sizes. A processor class with a video processor slot (Qwen's, InternVL's) needs torchvision to be built:
without it, ``save_checkpoint`` refuses with a ValueError saying so, and the CPU tests use ``paddleocr_vl``.

The tokenizer has one word per id of the model's vocabulary (``t<id>``), with the model's special tokens (image,
video, vision start and end) at the ids its config gives them and the chat template's own tokens at the top ids:
every generated id decodes to a word of its own, so a streamed answer spells the greedy token ids. Prompt text
written as ``t<id>`` words tokenizes to those ids.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["MODELS", "save_checkpoint", "answer_ids"]

QWEN = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
MODELS = (*QWEN, "internvl3-1b", "paddleocr_vl")
"""The models ``save_checkpoint`` builds (any other ``vision_utils`` family whose processor has no video slot
works too)."""

TINY_MAX_PATCHES = 128
"""Tiny packed models: each image resized to at most this many patches (the tests' budgets are 128 and 512)."""

TINY_TEXT_STD = 0.2
"""Tiny models: the language model's matrices drawn with this standard deviation. At the configs' 0.02 a one-layer
model with tied embeddings echoes its last prompt token whatever the image; at 0.2 the greedy answer depends on it."""


@dataclass(frozen=True)
class TokenLayout:
    """How a processor class finds its special tokens: tokenizer attributes (``tokenizer.image_token``) by token,
    the config field holding each one's id (None: any free id), and what the chat template writes per image."""

    named: dict[str, tuple[str, str | None]]
    """tokenizer attribute -> (token, config field of its id, or None)."""
    image: str
    """The chat template's text for one image."""
    plain: dict[str, str] = field(default_factory=dict)
    """Special tokens the template writes that the processor does not name: token -> config field of its id."""
    processor_options: tuple[str, ...] = ()
    """Processor keywords computed from the model (``image_seq_length``)."""


PACKED = TokenLayout(
    named={"image_token": ("<|image_pad|>", "image_token_id"), "video_token": ("<|video_pad|>", "video_token_id")},
    plain={"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id"},
    image="<|vision_start|><|image_pad|><|vision_end|>",
)
"""Qwen's processors and those of the families that copy them (PaddleOCR-VL): the image pad token between vision
start and end, expanded by the processor to one per merged token."""

TILES = TokenLayout(
    named={
        "context_image_token": ("<IMG_CONTEXT>", "image_token_id"),
        "start_image_token": ("<img>", None),
        "end_image_token": ("</img>", None),
        "video_token": ("<video>", None),
    },
    image="<IMG_CONTEXT>",
    processor_options=("image_seq_length",),
)
"""InternVL's processor: one context token per image, expanded to ``<img>``, the tile tokens, ``</img>``."""

CHAT = ("<|im_start|>", "<|im_end|>", "<unk>")
"""The chat template's own tokens, at the top ids of the vocabulary: turn start, turn end (the end of a turn and of
the sequence), unknown words."""


def _template(layout: TokenLayout) -> str:
    """A ChatML template: each turn ``<|im_start|>role text<|im_end|>``, images where the message puts them."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }} "
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + layout.image + "{% "
        "elif part['type'] == 'text' %} {{ part['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )


def _tokenizer(config, layout: TokenLayout):
    """A word-level tokenizer over the model's whole vocabulary (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = config.get_text_config().vocab_size
    fixed = {token: getattr(config, name) for token, name in layout.plain.items()}
    fixed |= {token: getattr(config, name) for token, name in layout.named.values() if name is not None}
    free = (index for index in range(vocab_size - 1, -1, -1) if index not in fixed.values())
    fixed |= {token: next(free) for token, name in layout.named.values() if name is None}
    fixed |= {token: next(free) for token in CHAT}
    words = {index: f"t{index}" for index in range(vocab_size)} | {index: token for token, index in fixed.items()}
    model = Tokenizer(models.WordLevel({word: index for index, word in words.items()}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        extra_special_tokens={name: token for name, (token, _) in layout.named.items()},
        additional_special_tokens=[token for token in fixed if token not in CHAT],
    )


def _model_and_image_processor(name: str, tiny: bool, device: str, dtype: torch.dtype, seed: int):
    from vgraph_compile.sample_models import vision_utils_vlms, qwen_vlms, tile_vlms

    if name in QWEN:
        model = qwen_vlms.qwen_vlm(name, tiny=tiny, device=device, dtype=dtype, seed=seed)
        return model, qwen_vlms.image_processor(model.config, max_patches=TINY_MAX_PATCHES if tiny else None)
    if name == "internvl3-1b":
        model = tile_vlms.internvl(tiny=tiny, device=device, dtype=dtype, seed=seed)
        return model, tile_vlms.tile_processor(model)
    model = vision_utils_vlms.build_vlm(name, tiny=tiny, device=device, dtype=dtype, seed=seed)
    return model, vision_utils_vlms.image_processor(name, model, max_patches=TINY_MAX_PATCHES if tiny else None)


def _video_processor(model_type: str, image_processor):
    """The model type's video processor at the image processor's patch sizes; a ValueError without torchvision."""
    from transformers.models.auto.video_processing_auto import (
        VIDEO_PROCESSOR_MAPPING_NAMES,
        video_processor_class_from_name,
    )
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise ValueError(
            f"{model_type}'s processor holds a video processor, which needs torchvision (pip install torchvision); "
            "without it, save a model whose processor takes none (paddleocr_vl)"
        )
    names = VIDEO_PROCESSOR_MAPPING_NAMES[model_type]  # by backend: {"torchvision": "Qwen2VLVideoProcessor"}
    processor_class = video_processor_class_from_name(names["torchvision"] if isinstance(names, dict) else names)
    sizes = ("patch_size", "temporal_patch_size", "merge_size")
    return processor_class(**{key: getattr(image_processor, key) for key in sizes if hasattr(image_processor, key)})


def save_checkpoint(
    name: str,
    directory: str | Path,
    tiny: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Save ``name``'s model (random weights drawn on ``device``, ``dtype``; tiny: see ``TINY_TEXT_STD``) and
    processor into ``directory``; returns it."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model, image_processor = _model_and_image_processor(name, tiny, device, dtype, seed)
    if tiny:
        generator = torch.Generator(device).manual_seed(seed)
        for parameter in model.get_decoder().parameters():
            if parameter.dim() > 1:
                parameter.data.normal_(0.0, TINY_TEXT_STD, generator=generator)
    config = model.config
    layout = TILES if config.model_type == "internvl" else PACKED
    if layout is PACKED and not hasattr(config, "vision_start_token_id"):
        raise ValueError(f"{name}: no checkpoint layout for {config.model_type} (its config has no vision start token)")
    processor_class = getattr(importlib.import_module("transformers"), PROCESSOR_MAPPING_NAMES[config.model_type])
    parts = {"image_processor": image_processor, "tokenizer": _tokenizer(config, layout)}
    if "video_processor" in processor_class.get_attributes():
        parts["video_processor"] = _video_processor(config.model_type, image_processor)
    options = {}
    if "image_seq_length" in layout.processor_options:
        from vgraph_compile.sample_models.tile_vlms import tokens_per_tile

        options["image_seq_length"] = tokens_per_tile(config)
    processor = processor_class(**parts, chat_template=_template(layout), **options)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def answer_ids(text: str) -> list[int]:
    """The token ids a decoded answer of a ``save_checkpoint`` tokenizer spells (its ``t<id>`` words)."""
    return [int(word[1:]) for word in text.split()]
