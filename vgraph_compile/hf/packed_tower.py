"""What vgraph learns about a packed vision tower (one that takes ``(pixel rows, grid)``) before serving it.

``learn_packed_tower(tower)`` reads the forward's signature (which argument is the grid), the config's geometry
(patch, temporal patch, merge; the window size when the tower builds windows), the pixel row layout
(``[patches, C*T*P*P]`` or ``[patches, C, (T,) P, P]``, the one the tower accepts), the grid metadata plan
(``grid_metadata``), and the output's fields with their rows per patch. It then checks the plan on a second grid
(a video and a one-merge-unit image): the tower called with the grid withheld and the planned metadata passed in
must give exactly the stock outputs, so nothing it reads from the grid escapes the plan.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.grid_metadata import MetadataPlan, record_metadata

__all__ = ["OutputField", "PackedTower", "grid_argument", "learn_packed_tower", "rows_per_unit"]

_MERGE_FIELDS = ("spatial_merge_size", "merge_size")
"""Config fields that hold the spatial merge (the two spellings of the vision_utils families)."""
_CHANNEL_FIELDS = ("in_channels", "num_channels")
_WINDOW_KEY = "cu_window_seqlens"
"""The metadata key of window-attention offsets (``get_vision_window_index``'s)."""


def grid_argument(tower: torch.nn.Module) -> str | None:
    """The forward's grid argument (``grid_thw``, ``image_grid_thw``...): the first one named ``*grid*``."""
    names = list(inspect.signature(type(tower).forward).parameters)[1:]
    return next((name for name in names if "grid" in name), None)


@dataclass(frozen=True)
class OutputField:
    """One field of the tower's output: a tensor, or a list of ``count`` tensors (deepstack levels)."""

    name: str
    count: int | None
    patches_per_row: int
    """Input patches per output row (1: last_hidden_state, merge^2: pooler_output)."""
    width: tuple[int, ...]


@dataclass(frozen=True)
class PackedTower:
    """A packed tower's interface, learned from the tower itself."""

    grid_argument: str
    geometry: VisionGeometry
    pixel_shape: tuple[int, ...]
    """Trailing dims of one pixel row."""
    metadata: MetadataPlan
    metadata_patches_per_row: dict[str, int]
    """Metadata tensors whose dim 0 is a fixed fraction of the patches (position ids: 1; window index: merge^2)."""
    output_class: type
    outputs: tuple[OutputField, ...]

    @property
    def windowed(self) -> bool:
        return _WINDOW_KEY in self.metadata.keys


def _config_value(config, fields: tuple[str, ...], default: Any = None) -> Any:
    return next((getattr(config, name) for name in fields if getattr(config, name, None) is not None), default)


def _geometry(tower: torch.nn.Module, windowed: bool) -> VisionGeometry:
    config = tower.config
    merge, patch = _config_value(config, _MERGE_FIELDS), getattr(config, "patch_size", None)
    if not isinstance(merge, int) or not isinstance(patch, int):
        raise ValueError(
            f"{type(tower).__name__} cannot be served by vgraph: its config has no integer patch_size and "
            f"spatial merge size ({' or '.join(_MERGE_FIELDS)}), so the bounds of its buckets are unknown"
        )
    window = getattr(config, "window_size", None) if windowed else None
    if windowed and not isinstance(window, int):
        raise ValueError(f"{type(tower).__name__} builds attention windows but its config has no window_size")
    return VisionGeometry(
        patch_size=patch,
        temporal_patch_size=getattr(config, "temporal_patch_size", None) or 1,
        spatial_merge_size=merge,
        window_size=window,
    )


def _pixel_shapes(tower: torch.nn.Module) -> list[tuple[int, ...]]:
    """The row layouts to try: flattened first, then channels x (temporal x) patch x patch."""
    config = tower.config
    channels = _config_value(config, _CHANNEL_FIELDS, 3)
    temporal = getattr(config, "temporal_patch_size", None) or 1
    patch = config.patch_size
    shapes = [(channels * temporal * patch * patch,), (channels, temporal, patch, patch)]
    return shapes if temporal > 1 else [shapes[0], (channels, patch, patch)]


def _patches_per_row(patch_counts: list[int], row_counts: list[int]) -> int | None:
    ratios = {patches // rows if rows and patches % rows == 0 else None for patches, rows in zip(patch_counts, row_counts)}
    return ratios.pop() if len(ratios) == 1 else None


def _fields(output) -> dict[str, Any]:
    return {name: value for name, value in output.items() if value is not None}


def _row_count(value) -> int:
    return (value[0] if isinstance(value, (list, tuple)) else value).shape[0]


def _inputs(tower, shape, grid) -> tuple[torch.Tensor, torch.Tensor]:
    parameter = next(tower.parameters())
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    patches = int(grid_thw.prod(-1).sum())
    generator = torch.Generator().manual_seed(0)
    pixel_values = torch.randn(patches, *shape, generator=generator).to(parameter.device, parameter.dtype)
    return pixel_values, grid_thw


def _record(tower, grid) -> tuple[tuple[int, ...], MetadataPlan, Any]:
    failures = []
    for shape in _pixel_shapes(tower):
        pixel_values, grid_thw = _inputs(tower, shape, grid)
        try:
            plan, output = record_metadata(tower, pixel_values, grid_argument(tower), grid_thw)
        except ValueError:
            raise
        except Exception as error:  # the tower refused this row layout: try the next one
            failures.append(f"{shape}: {type(error).__name__}: {error}")
            continue
        return shape, plan, output
    raise ValueError(f"{type(tower).__name__} accepted no pixel row layout vgraph knows ({'; '.join(failures)})")


def _refuse(tower, reason: str) -> ValueError:
    return ValueError(f"{type(tower).__name__} cannot be served by vgraph: {reason}")


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def learn_packed_tower(tower: torch.nn.Module) -> PackedTower:
    """The tower's interface (see the module docstring); ``ValueError`` naming the reason when it cannot be served."""
    name = grid_argument(tower)
    extra = [
        parameter.name
        for parameter in list(inspect.signature(type(tower).forward).parameters.values())[2:]
        if parameter.name != name and parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    if extra:
        raise _refuse(tower, f"its forward takes {extra} besides the pixel rows and {name}")
    config = tower.config
    merge = _config_value(config, _MERGE_FIELDS)
    merge = merge if isinstance(merge, int) else 1
    first = [(1, 4 * merge, 8 * merge)]
    second = [(2, 2 * merge, 4 * merge), (1, merge, merge)]
    with torch.no_grad(), routed_attention(tower):
        shape, plan, first_output = _record(tower, first)
        pixel_values, grid_thw = _inputs(tower, shape, second)
        try:
            expected = tower(pixel_values, **{name: grid_thw})
        except Exception as error:
            raise _refuse(tower, f"the stock tower fails on the grid {second}: {type(error).__name__}: {error}") from error
        metadata = plan.compute(grid_thw)
        first_metadata = plan.compute(torch.tensor(first))
        try:
            served = tower(pixel_values, **{name: None}, **metadata)
        except Exception as error:
            raise _refuse(
                tower, f"it uses {name} outside its metadata functions ({plan.describe()}): {type(error).__name__}: "
                f"{error}"
            ) from error
    if type(served) is not type(expected) or _fields(served).keys() != _fields(expected).keys():
        raise _refuse(tower, "its output differs when the grid metadata is passed in")
    for field_name, value in _fields(expected).items():
        if not _same(value, _fields(served)[field_name]):
            raise _refuse(tower, f"its {field_name} differs when {plan.describe()} are passed in: it reads {name} "
                          "elsewhere too")
    patch_counts = [int(torch.tensor(grid).prod(-1).sum()) for grid in (first, second)]
    relations = {}
    for key, value in metadata.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            ratio = _patches_per_row(patch_counts, [first_metadata[key].shape[0], value.shape[0]])
            if ratio is not None:
                relations[key] = ratio
    outputs = []
    for field_name, value in _fields(expected).items():
        ratio = _patches_per_row(patch_counts, [_row_count(_fields(first_output)[field_name]), _row_count(value)])
        if ratio is None:
            raise _refuse(tower, f"its output {field_name} has no fixed number of rows per patch")
        count = len(value) if isinstance(value, (list, tuple)) else None
        width = tuple((value[0] if count else value).shape[1:])
        outputs.append(OutputField(field_name, count, ratio, width))
    windowed = _WINDOW_KEY in plan.keys
    outputs.sort(key=lambda field: field.name != "pooler_output")  # flat outputs: the features a VLM reads first
    return PackedTower(name, _geometry(tower, windowed), shape, plan, relations, type(expected), tuple(outputs))


def rows_per_unit(outputs: tuple[OutputField, ...]) -> tuple[int, list[int]]:
    """(patches per unit, each field's rows per unit): a unit is the coarsest field's row (a merged token)."""
    unit = math.lcm(*(field.patches_per_row for field in outputs))
    return unit, [unit // field.patches_per_row for field in outputs]
