"""A small tower of a packed tower's own class and config: what vgraph probes to learn the tower's interface.

The interface (``packed_tower``) depends on the tower's code and config, never on its weights, so it is learned
from a tower built fresh from the same class and a copy of the config, shrunk in depth:

- every run of consecutive blocks that no layer-index field of the config names (``fullatt_block_indexes``,
  ``deepstack_visual_indexes``...: a field named ``*index*``/``*layer*`` holding non-negative ints under the
  depth) becomes one block, and those fields are renumbered to match. Qwen2.5-VL-7B's 32 blocks with full
  attention at 7, 15, 23 and 31 become 8 (full attention at 1, 3, 5, 7); Qwen3-VL-8B's 27 with deepstack taps at
  8, 16 and 24 become 7. Each kind of block, and each tap, is still there, in the same order;
- the blocks' MLP width (``intermediate_size``) is cut to ``MLP_WIDTH``: no output, pixel row or metadata of
  the interface has that width, and the MLP holds most of a block's weights and work;
- every other width is kept: the interface records the output fields' widths and the pixel row's shape.

It is built on the host, in the tower's dtype, with initialization skipped (random initialization of a few hundred million
weights would take seconds) and every parameter filled with one fixed pseudo-random sequence, scaled by its fan-in
(a copy, at memory speed): the probe compares outputs exactly, so values need only be finite and deterministic, and
rows distinct. The caller's random state is not touched. A probe grid the
stock code cannot take raises a Python error there (an index past the grid's rows, as the GLM-4.1V towers index
their grid per frame on a video), where on a GPU it would be a device-side assert that ends the process's CUDA
context. The user's tower is never moved, copied or called.

Invariant: the shrunk tower is of the tower's own class, with a config that differs from the tower's only in its
depth field, the layer-index fields renumbered to it, and its MLP width.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch

__all__ = ["fill_parameters", "shrunk_config", "shrunk_tower"]

log = logging.getLogger(__name__)

DEPTH_FIELDS = ("depth", "num_hidden_layers", "num_layers")
"""Config fields that hold a tower's number of blocks, as the families spell them."""
MLP_WIDTH_FIELDS = ("intermediate_size",)
"""Config fields that hold the width inside a block's MLP."""
MLP_WIDTH = 16
_INDEX_WORDS = ("index", "indices", "layer")
_PERIOD = 65_537
"""Length of the pseudo-random sequence the parameters repeat: a prime, so no two rows of a weight agree."""


def _layer_indexes(config: Any, depth_field: str, depth: int) -> dict[str, list[int]] | None:
    """The config's layer-index fields and their values; None when a field named like one holds something else
    (a negative index, an int, an index past the depth): then the depth cannot be shrunk safely."""
    fields = {}
    for name, value in vars(config).items():
        if name == depth_field or name.startswith("_") or not any(word in name for word in _INDEX_WORDS):
            continue
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        if not isinstance(value, (list, tuple)) or not all(type(item) is int and 0 <= item < depth for item in value):
            return None
        fields[name] = list(value)
    return fields


def shrunk_config(config: Any) -> Any:
    """A copy of ``config`` with its MLP width and depth shrunk as the module docstring says (its depth kept when
    it has no depth field, or a layer-index field the renumbering cannot read)."""
    shrunk = copy.deepcopy(config)
    for name in MLP_WIDTH_FIELDS:
        if type(getattr(config, name, None)) is int:
            setattr(shrunk, name, min(getattr(config, name), MLP_WIDTH))
    depth_field = next((name for name in DEPTH_FIELDS if type(getattr(config, name, None)) is int), None)
    if depth_field is None:
        return shrunk
    depth = getattr(config, depth_field)
    indexes = _layer_indexes(config, depth_field, depth)
    if indexes is None:
        return shrunk
    named = {index for values in indexes.values() for index in values}
    renumbered, blocks = {}, 0
    for layer in range(depth):
        if layer in named:
            renumbered[layer] = blocks
            blocks += 1
        elif layer == 0 or layer - 1 in named:  # the first block of a run no field names
            blocks += 1
    setattr(shrunk, depth_field, blocks)
    for name, values in indexes.items():
        setattr(shrunk, name, type(getattr(config, name))(renumbered[index] for index in values))
    return shrunk


def fill_parameters(module: torch.nn.Module) -> None:
    """Fill every floating parameter of ``module`` with one fixed pseudo-random sequence in [-1, 1), scaled by
    1 / sqrt(fan-in) (a weight's elements past its first dim; 1 for a vector), each parameter starting at its own
    offset."""
    sequence = torch.rand(_PERIOD, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        for offset, parameter in enumerate(module.parameters()):
            if not parameter.is_floating_point() or not parameter.numel():
                continue
            contiguous = parameter.is_contiguous()
            target = parameter if contiguous else torch.empty(parameter.shape, dtype=parameter.dtype)
            flat = target.view(-1)
            scale = 1.0 if parameter.dim() < 2 else (flat.numel() // parameter.shape[0]) ** -0.5
            pattern = torch.roll(sequence, offset).to(parameter.dtype) * scale
            whole = flat.numel() // _PERIOD
            flat[: whole * _PERIOD].view(whole, _PERIOD).copy_(pattern.expand(whole, _PERIOD))
            flat[whole * _PERIOD :].copy_(pattern[: flat.numel() - whole * _PERIOD])
            if not contiguous:
                parameter.copy_(target)


def shrunk_tower(tower: torch.nn.Module) -> torch.nn.Module | None:
    """A tower of ``tower``'s class built from its shrunk config, on the host in the tower's floating dtype (float32
    otherwise), in eval mode; None (logged) when the class cannot be built from its config alone."""
    kind = type(tower)
    config = shrunk_config(tower.config)
    dtype = next((p.dtype for p in tower.parameters() if p.is_floating_point()), torch.float32)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), _initialization_skipped():
            if hasattr(kind, "_from_config"):
                built = kind._from_config(config, attn_implementation="sdpa", dtype=dtype)
            else:
                built = kind(config).to(dtype)
    except Exception as error:  # any class that needs more than its config: the tower is probed itself
        log.info("vgraph: %s cannot be built from its config alone (%s: %s); probing the tower itself",
                 kind.__name__, type(error).__name__, error)  # fmt: skip
        return None
    fill_parameters(built)
    return built.eval()


def _initialization_skipped():
    """transformers' ``no_init_weights`` (torch's and the model's own initializers do nothing), where this
    transformers has it (``transformers.initialization``, earlier ``transformers.modeling_utils``)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()
