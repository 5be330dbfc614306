"""The transformers families whose vision tower takes its grid metadata from ``transformers.vision_utils``, found
by reading the installed transformers (no list of names), and their towers built from each family's own config
class, at released sizes or shrunk for tests (random weights: nothing is downloaded).

A family's tower is the outermost ``PreTrainedModel`` subclass of its modeling module that declares a vision
config class (``config: XVisionConfig``); the tower is built from that config class.
"""

from __future__ import annotations

import functools
import glob
import importlib
import inspect
import pathlib
import re
from dataclasses import dataclass

import torch

from vgraph_compile.sample_models.qwen_towers import REAL_SIZES

__all__ = [
    "Family",
    "vision_utils_families",
    "family",
    "build_tower",
    "declared_config",
    "released_config",
    "shrunk",
    "tower_call",
    "TINY_SIZES",
]

TINY_SIZES = dict(
    depth=1,
    num_hidden_layers=1,
    num_layers=1,
    hidden_size=32,
    embed_dim=32,
    width=32,
    num_heads=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    out_hidden_size=48,
    num_position_embeddings=64,
    pos_emb_height=8,
    pos_emb_width=8,
    fullatt_block_indexes=[1],
    deepstack_visual_indexes=[0],
)
"""Config fields that size a tower, shrunk: a field is set only where the family's config has it (one block,
width 32, 2 heads, merger output 48, a 8 x 8 position table: a tower whose window is that table's side gets
windows of 8 patches). A tower with window blocks (its config lists its
full-attention blocks, ``fullatt_block_indexes``) gets two (``shrunk``)."""


@dataclass(frozen=True)
class Family:
    """One family: its transformers model type, tower class and the tower's config class."""

    name: str
    tower_class: type
    config_class: type


def _modeling_modules(pattern: str = "*") -> list[str]:
    """The modeling modules (of the families matching ``pattern``) that import ``transformers.vision_utils``."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(root.glob(f"{pattern}/modeling_*.py")):
        if re.search(r"^from \.\.\.vision_utils import|^from transformers\.vision_utils", path.read_text(), re.M):
            found.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return found


def declared_config(model_class: type) -> type | None:
    """The config class a model class declares (``config: XConfig`` on it or a base), None when none does."""
    annotations = (inspect.get_annotations(base) for base in model_class.__mro__)
    return next((found["config"] for found in annotations if "config" in found), None)


def _tower_of(module) -> tuple[type, type] | None:
    """The last-defined model class of ``module`` declaring a vision config (a tower wrapping another comes after
    it: ``PaddleOCRVisionModel`` holds a ``PaddleOCRVisionTransformer``), ordered by where its ``forward`` is
    defined (inside its class body)."""
    from transformers import PreTrainedModel

    found = []
    for value in vars(module).values():
        if not (inspect.isclass(value) and issubclass(value, PreTrainedModel) and value.__module__ == module.__name__):
            continue
        config_class = declared_config(value)
        if inspect.isclass(config_class) and "Vision" in config_class.__name__ and "forward" in value.__dict__:
            found.append((inspect.unwrap(value.forward).__code__.co_firstlineno, value, config_class))
    return max(found, key=lambda entry: entry[0])[1:] if found else None


def _families(pattern: str) -> dict[str, Family]:
    families = {}
    for module_name in _modeling_modules(pattern):
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a family needing an optional package
            continue
        found = _tower_of(module)
        if found is not None:
            name = module_name.split(".")[2]
            families[name] = Family(name, *found)
    return families


@functools.cache
def vision_utils_families() -> dict[str, Family]:
    """Every family of the installed transformers whose modeling module imports ``transformers.vision_utils``,
    by model type (``glm4v``); a family with no tower class found (the import serves another part) is left out."""
    return _families("*")


@functools.cache
def family(name: str) -> Family:
    """One family, importing its modeling module only."""
    found = _families(glob.escape(name)) if name and "/" not in name else {}
    if name not in found:
        families = sorted(vision_utils_families())
        raise ValueError(f"no vision_utils family {name!r} in the installed transformers: one of {families}")
    return found[name]


def _tied_fields(defaults: dict, sizes: dict) -> dict:
    """The default fields tied to a shrunk size, shrunk with it: a width equal to the hidden size
    (``adapter_in_dim``), a per-layer list (``mlp_layer_types``) or a dict keyed by layer index
    (``per_layer_config``), cut to the shrunk layer count. A config's validation checks such ties."""
    layer_fields = [key for key in ("depth", "num_hidden_layers", "num_layers") if key in sizes]
    layers = sizes[layer_fields[0]] if layer_fields else None
    default_layers = defaults[layer_fields[0]] if layer_fields else None
    tied = {}
    for key, value in defaults.items():
        if key in sizes:
            continue
        if "hidden_size" in sizes and type(value) is int and value == defaults["hidden_size"]:
            tied[key] = sizes["hidden_size"]
        elif layers is not None and isinstance(value, list) and len(value) == default_layers:
            tied[key] = value[:layers]
        elif layers is not None and isinstance(value, dict) and value and all(str(i).isdigit() for i in value):
            tied[key] = {index: entry for index, entry in value.items() if int(index) < layers}
    return tied


def shrunk(defaults: dict, sizes: dict, windowed_depth: int | None = 2) -> dict:
    """The fields of ``sizes`` that a config with these ``defaults`` has, with the same type (an int for an int;
    any for None), and the fields tied to them (``_tied_fields``). A config listing full-attention blocks among
    window blocks (``fullatt_block_indexes``) keeps ``windowed_depth`` layers (two: a window block, then a
    full-attention one; None: the depth of ``sizes``)."""
    out = {
        key: value
        for key, value in sizes.items()
        if key in defaults and (defaults[key] is None or type(defaults[key]) is type(value))
    }
    if "fullatt_block_indexes" in out and windowed_depth is not None:
        out.update({key: windowed_depth for key in ("depth", "num_hidden_layers", "num_layers") if key in out})
    return {**out, **_tied_fields(defaults, out)}


def released_config(name: str) -> dict:
    """The family's released vision config as a dict (its class's defaults, or ``REAL_SIZES``)."""
    spec = family(name)
    released = next(
        (sizes for *_, config_name, sizes in REAL_SIZES.values() if config_name == spec.config_class.__name__), {}
    )
    return spec.config_class(**released).to_dict()


def build_tower(
    name: str,
    tiny: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attention: str = "sdpa",
    **fields,
) -> torch.nn.Module:
    """The family's tower with random weights, in eval mode: the released sizes (the config class's defaults, or
    ``qwen_towers.REAL_SIZES`` where a released tower's config is not its class's default, as Qwen2.5-VL's),
    ``TINY_SIZES`` over them with ``tiny``, then ``fields``."""
    spec = family(name)
    released = next(
        (sizes for *_, config_name, sizes in REAL_SIZES.values() if config_name == spec.config_class.__name__), {}
    )
    sizes = shrunk(released_config(name), TINY_SIZES) if tiny else dict(released)
    torch.manual_seed(seed)
    config = spec.config_class(**{**sizes, **fields})
    tower = spec.tower_class._from_config(config, attn_implementation=attention)
    return tower.to(device, dtype).eval()


_TEMPORAL_FIELDS = ("temporal_patch_size", "patch_temporal")
"""Config fields of the temporal patch, as the families spell them."""
TILED_ROWS = {"minicpm_ocr", "minicpmv4_6", "minicpmv4_7"}
"""Families that take their patches as one strip image ``[1, C, P, patches * P]`` with ``target_sizes`` (h, w)."""
MERGED_GRID = {"inkling2"}
"""Families that take one row per merged token, ``[tokens, P*m, P*m, C]``, with the grid counted in tokens."""


def tower_call(name: str, tower: torch.nn.Module, grid) -> tuple[tuple, dict]:
    """(args, kwargs) of the family's stock tower for packed items of ``grid`` (t, h, w in patches; h, w even), in
    the family's input layout: patch rows ``[patches, C*T*P*P]`` with the grid unless a table above says
    otherwise (random pixels in the tower's dtype; every tensor on the tower's device, as a model passes them)."""
    config = tower.config
    parameter = next(tower.parameters())
    patch, channels = config.patch_size, getattr(config, "num_channels", 3)
    grid_thw = torch.tensor(grid, device=parameter.device)
    patches = int(grid_thw.prod(-1).sum())
    if name in TILED_ROWS:
        return (_pixels(parameter, 1, channels, patch, patches * patch), grid_thw[:, 1:].int()), {}
    if name in MERGED_GRID:
        merge = config.spatial_merge_size
        tokens = grid_thw // torch.tensor([1, merge, merge], device=parameter.device)
        return (_pixels(parameter, patches // merge**2, patch * merge, patch * merge, channels), tokens), {}
    temporal = next((getattr(config, name) for name in _TEMPORAL_FIELDS if getattr(config, name, None)), 1)
    width = channels * temporal * patch**2
    args = (_pixels(parameter, patches, width), grid_thw)
    merge_sizes = torch.full((len(grid),), 2, device=parameter.device)
    return args, ({"merge_sizes": merge_sizes} if name == "video_llama_3" else {})


def _pixels(parameter: torch.Tensor, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=parameter.device).to(parameter.dtype)
