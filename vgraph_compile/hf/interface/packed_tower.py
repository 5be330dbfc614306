"""What vgraph learns about a packed vision tower (one that takes ``(pixel rows, grid)``) before serving it.

``learn_packed_tower(tower)`` reads the forward's signature (which argument is the grid), the config's geometry
(patch, temporal patch, merge; the window size when the tower builds windows, from the config or else from the
constant the tower passes to its window call), the pixel row layout
(``[patches, C*T*P*P]`` or ``[patches, C, (T,) P, P]``, the one the tower accepts; with a leading batch dim of 1,
``[1, patches, ...]``, when only that fits), the grid metadata plan (``metadata_plan``), and the output's fields
with their rows per patch. It then checks the plan on a second grid (a video and a one-merge-unit image): the
tower called with the grid withheld and the planned metadata passed in must give exactly the stock outputs, so
nothing it reads from the grid escapes the plan.

Grid tables: a tower that reads its grid as a device tensor outside its metadata functions (GLM-4.1V's bicubic
position resize indexes ``grid_thw[segment, 1]`` per patch) fails that check. It is then made with the grid
passed too, as a fixed-size table padded with one-merge-unit rows (``PackedTower.grid_table``): if the outputs are
still exactly the stock ones, the trace takes that table as an input and its device reads are traced.

Image-only towers: when that check fails on the video (the stock tower itself fails on more than one frame, or its
rows do not scale with frames), it is made on two images instead, and ``PackedTower.video_failure`` keeps the
video's reason: the tower is served on images only, and a grid with t > 1 is refused per call with that reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vgraph_compile.counters import counters
from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.metadata_plan import MetadataPlan, TowerRefused, record_metadata
from vgraph_compile.hf.interface.shrunk_tower import shrunk_tower

__all__ = [
    "ENVIRONMENT_ERRORS",
    "OutputField",
    "PackedTower",
    "config_geometry",
    "grid_argument",
    "learn_packed_tower",
    "metadata_leaves",
    "refused_by_environment",
    "rows_per_unit",
]

_MERGE_FIELDS = ("spatial_merge_size", "merge_size", "merge_kernel_size")
"""Config fields that hold the spatial merge (an int, or a square kernel as equal ints), as the vision_utils
families spell it."""
_TEMPORAL_FIELDS = ("temporal_patch_size", "patch_temporal")
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
    batched: bool = False
    """The field carries a leading batch dim of 1 (``[1, rows, ...]``), like a batched tower's pixel_values."""

    @property
    def tensors(self) -> int:
        """How many tensors the field holds: 1 for a tensor, ``count`` for a list (0 for an empty one: a deepstack
        list when no block of this depth is tapped)."""
        return 1 if self.count is None else self.count


@dataclass(frozen=True)
class PackedTower:
    """A packed tower's interface, learned from the tower itself."""

    grid_argument: str
    geometry: VisionGeometry
    pixel_shape: tuple[int, ...]
    """Trailing dims of one pixel row."""
    metadata: MetadataPlan
    metadata_patches_per_row: dict[tuple[str, int], int]
    """Metadata parts (key, part of ``metadata_leaves``) whose length (a tensor's dim 0, or an int) is a fixed
    fraction of the patches (position ids: 1; window index: merge^2; a merged-token count: merge^2)."""
    output_class: type
    outputs: tuple[OutputField, ...]
    video_failure: str | None = None
    """Why grids with more than one frame are refused (the stock tower fails on them); None: videos are served."""
    batched: bool = False
    """pixel_values carry a leading batch dim of 1 (``[1, patches, ...]``), as do the ``OutputField.batched``
    outputs."""
    grid_traced: bool = False
    """The tower reads its grid outside its metadata functions: the traced call takes it as ``grid_table``."""

    @property
    def windowed(self) -> bool:
        return _WINDOW_KEY in self.metadata.keys

    def pixel_values_shape(self, patches: int) -> tuple[int, ...]:
        """The shape of the tower's pixel_values for ``patches`` patch rows (its leading dim of 1 included)."""
        return ((1,) if self.batched else ()) + (patches, *self.pixel_shape)

    def bound(self, tower: torch.nn.Module | None) -> "PackedTower":
        """This interface, its metadata plan reading ``tower``'s config (None: unbound, as it is saved)."""
        return dataclasses.replace(self, metadata=self.metadata.bound(getattr(tower, "config", None)))

    def grid_table(self, grid_thw: torch.Tensor, rows: int) -> torch.Tensor:
        """The grid as a ``grid_traced`` tower's traced call takes it (``grid_table``)."""
        return grid_table(grid_thw, rows, self.geometry.spatial_merge_size)


def grid_table(grid_thw: torch.Tensor, rows: int, merge: int) -> torch.Tensor:
    """``grid_thw``'s rows, then one-merge-unit image rows ``(1, merge, merge)`` up to ``rows``: any segment index
    up to ``rows - 1`` (a padded segment's) reads a valid image size, and the table has one shape for every call."""
    padding = grid_thw.new_tensor([1, merge, merge]).expand(rows - grid_thw.shape[0], 3)
    return torch.cat([grid_thw, padding])


def _config_value(config, fields: tuple[str, ...], default: Any = None) -> Any:
    return next((getattr(config, name) for name in fields if getattr(config, name, None) is not None), default)


def _merge(config) -> int | None:
    """The spatial merge of the config: an int field, or a square kernel ``(2, 2)``; None when neither."""
    merge = _config_value(config, _MERGE_FIELDS)
    if isinstance(merge, (list, tuple)) and len(set(merge)) == 1:
        merge = merge[0]
    return merge if isinstance(merge, int) else None


def _temporal_patch(config) -> int:
    return _config_value(config, _TEMPORAL_FIELDS, 1)


def _window_size(config, plan: MetadataPlan) -> int | None:
    """The window side in pixels: the config's ``window_size``, else the constant ``window_size`` the tower passed
    to the call that built its windows (Muse derives it from its position table: ``pos_emb_height * patch``);
    None when the tower builds no windows, or neither is an int."""
    window = getattr(config, "window_size", None)
    calls = [call for call in plan.calls if _WINDOW_KEY in call.keys]
    if not isinstance(window, int) and calls:
        window = calls[0].arguments.get("window_size")
    return window if calls and isinstance(window, int) else None


def _geometry(tower: torch.nn.Module, plan: MetadataPlan) -> VisionGeometry:
    config = tower.config
    merge, patch = _merge(config), getattr(config, "patch_size", None)
    if not isinstance(merge, int) or not isinstance(patch, int):
        raise _refuse(
            tower, f"its config has no integer patch_size and spatial merge size ({' or '.join(_MERGE_FIELDS)}), "
            "so the bounds of its buckets are unknown"
        )
    window = _window_size(config, plan)
    if _WINDOW_KEY in plan.keys and window is None:
        raise _refuse(tower, "it builds attention windows but neither its config nor its window call gives a "
                      "constant window_size")
    return config_geometry(config, window)


def config_geometry(config, window_size: int | None = None) -> VisionGeometry:
    """The geometry a vision config states (patch, temporal patch, merge, as the families spell them)."""
    return VisionGeometry(
        patch_size=config.patch_size,
        temporal_patch_size=_temporal_patch(config),
        spatial_merge_size=_merge(config),
        window_size=window_size,
    )


@dataclass(frozen=True)
class _Layout:
    """A pixel row layout: the trailing dims of one row, and whether the rows carry a leading batch dim of 1."""

    shape: tuple[int, ...]
    batched: bool

    def describe(self) -> str:
        dims = ", ".join(map(str, self.shape))
        return f"[1, patches, {dims}]" if self.batched else f"[patches, {dims}]"


def _layouts(tower: torch.nn.Module) -> list[_Layout]:
    """The row layouts to try: flattened first, then channels x (temporal x) patch x patch; packed along dim 0,
    then the same with a leading batch dim of 1."""
    config = tower.config
    channels = _config_value(config, _CHANNEL_FIELDS, 3)
    temporal = _temporal_patch(config)
    patch = config.patch_size
    shapes = [(channels * temporal * patch * patch,), (channels, temporal, patch, patch)]
    shapes = shapes if temporal > 1 else [shapes[0], (channels, patch, patch)]
    return [_Layout(shape, batched) for batched in (False, True) for shape in shapes]


def _patches_per_row(patch_counts: list[int], row_counts: list[int]) -> int | None:
    pairs = zip(patch_counts, row_counts)
    ratios = {patches // rows if rows and patches % rows == 0 else None for patches, rows in pairs}
    return ratios.pop() if len(ratios) == 1 else None


def _fields(output) -> dict[str, Any]:
    return {name: value for name, value in output.items() if value is not None}


def _first_tensor(value) -> torch.Tensor:
    """The field's tensor, or the first of its list (``_verify`` handles an empty list before asking)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _rows_dim(layout: _Layout, first, second) -> int:
    """1 for an output field that carries the batched pixel rows' leading dim of 1 on both grids, else 0."""
    return int(layout.batched and all(_first_tensor(value).shape[0] == 1 for value in (first, second)))


def _inputs(tower, layout: _Layout, grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe inputs on the tower's device, grid included, as a model passes them (the stock tower computes its
    metadata on the grid's device and indexes its own weights with it)."""
    parameter = next(tower.parameters())
    grid_thw = torch.tensor(grid, dtype=torch.int64, device=parameter.device)
    patches = int(grid_thw.prod(-1).sum())
    generator = torch.Generator().manual_seed(0)
    pixel_values = torch.randn(patches, *layout.shape, generator=generator).to(parameter.device, parameter.dtype)
    return pixel_values[None] if layout.batched else pixel_values, grid_thw


ENVIRONMENT_ERRORS = (MemoryError, ImportError, OSError, torch.OutOfMemoryError)
"""Errors of the machine a probe ran on, not of the tower's code and config: a refusal they cause says nothing
about another process (``refused_by_environment``)."""


def refused_by_environment(refusal: TowerRefused) -> bool:
    """Whether an error of ``ENVIRONMENT_ERRORS`` caused ``refusal`` (anywhere in its chain of causes)."""
    error: BaseException | None = refusal
    while error is not None:
        if isinstance(error, ENVIRONMENT_ERRORS):
            return True
        error = error.__cause__
    return False


def _record(tower, grid) -> tuple[_Layout, MetadataPlan, Any]:
    failures, environment = [], None
    for layout in _layouts(tower):
        pixel_values, grid_thw = _inputs(tower, layout, grid)
        counters.probe_forwards += 1
        try:
            plan, output = record_metadata(tower, pixel_values, grid_argument(tower), grid_thw)
        except TowerRefused:
            raise
        except Exception as error:  # the tower refused this row layout: try the next one
            failures.append(f"{layout.describe()}: {type(error).__name__}: {error}")
            environment = environment or (error if isinstance(error, ENVIRONMENT_ERRORS) else None)
            continue
        return layout, plan, output
    raise _refuse(
        tower, f"no pixel row layout derived from its config fits its patch embedding ({'; '.join(failures)})"
    ) from environment


def _failing_line(error: Exception) -> str:
    """The innermost line of transformers' model code in the traceback of ``error``."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "/transformers/models/" in frame.filename]
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/transformers/', 1)[-1]}:{frame.lineno} ({frame.line})"


def _refuse(tower, reason: str) -> TowerRefused:
    return TowerRefused(f"{type(tower).__name__} cannot be served by vgraph: {reason}")


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


@dataclass(frozen=True)
class _Verified:
    """What a verification grid showed: the output class and fields, and the metadata's rows per patch."""

    output_class: type
    outputs: tuple[OutputField, ...]
    metadata_patches_per_row: dict[tuple[str, int], int]
    grid_traced: bool


def metadata_leaves(value: Any) -> tuple:
    """A metadata value's parts: the value, or the items of a tuple (``(index, weights, count)``)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _leaf_sizes(value: Any) -> list[int | None]:
    """Each part's length: a tensor's dim 0, an int itself; None for other parts."""
    return [
        leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf if type(leaf) is int else None
        for leaf in metadata_leaves(value)
    ]


def _served(tower, layout: _Layout, plan: MetadataPlan, grid: list, grid_traced: bool):
    """(the stock output, the output with the grid withheld, or passed as a padded table, and the planned
    metadata passed in) on ``grid``; ``TowerRefused`` naming the failing line when either call fails."""
    name = grid_argument(tower)
    pixel_values, grid_thw = _inputs(tower, layout, grid)
    counters.probe_forwards += 1
    try:
        expected = tower(pixel_values, **{name: grid_thw})
    except Exception as error:
        raise _refuse(tower, f"the stock tower fails on the grid {grid}: {type(error).__name__}: {error}") from error
    given = grid_table(grid_thw, len(grid) + 2, _merge(tower.config) or 1) if grid_traced else None
    counters.probe_forwards += 1
    try:
        served = tower(pixel_values, **{name: given}, **plan.compute(grid_thw))
    except Exception as error:
        raise _refuse(
            tower, f"it uses {name} outside its metadata functions ({plan.describe()}) at {_failing_line(error)}: "
            f"{type(error).__name__}: {error}"
        ) from error
    if type(served) is not type(expected) or _fields(served).keys() != _fields(expected).keys():
        raise _refuse(tower, "its output differs when the grid metadata is passed in")
    for field_name, value in _fields(expected).items():
        if not _same(value, _fields(served)[field_name]):
            raise _refuse(tower, f"its {field_name} differs when {plan.describe()} are passed in: it reads {name} "
                          "elsewhere too")
    return expected


def _verify(tower, layout: _Layout, plan: MetadataPlan, first: list, first_output, second: list) -> _Verified:
    """The tower on ``second`` with the grid withheld and the planned metadata passed in gives exactly the stock
    outputs (or, failing that, with the grid passed as a table padded with one-merge-unit rows: ``grid_traced``),
    and every output field and metadata tensor has one number of rows per patch over both grids;
    ``TowerRefused`` naming what broke otherwise (why the grid could not be withheld)."""
    try:
        expected, grid_traced = _served(tower, layout, plan, second, grid_traced=False), False
    except TowerRefused as withheld:
        try:
            expected, grid_traced = _served(tower, layout, plan, second, grid_traced=True), True
        except TowerRefused:
            raise withheld from None
    metadata = plan.compute(torch.tensor(second))
    first_metadata = plan.compute(torch.tensor(first))
    patch_counts = [int(torch.tensor(grid).prod(-1).sum()) for grid in (first, second)]
    relations = {}
    for key, value in metadata.items():
        if isinstance(value, torch.Tensor) and value.shape[1:] != first_metadata[key].shape[1:]:
            raise _refuse(tower, f"its grid metadata {key} grows with the grid along a dim past dim 0 "
                          f"({tuple(first_metadata[key].shape)} then {tuple(value.shape)}): vgraph bounds dim 0 only")
        for leaf, (first_size, size) in enumerate(zip(_leaf_sizes(first_metadata[key]), _leaf_sizes(value))):
            ratio = _patches_per_row(patch_counts, [first_size, size]) if size is not None else None
            if ratio is not None:
                relations[key, leaf] = ratio
    outputs = []
    for field_name, value in _fields(expected).items():
        first_value = _fields(first_output)[field_name]
        if isinstance(value, (list, tuple)) and not (value and first_value):
            if value or first_value:
                raise _refuse(tower, f"its output {field_name} is a list whose length changes with the grid")
            outputs.append(OutputField(field_name, 0, 1, ()))  # no rows: any patches per row holds
            continue
        dim = _rows_dim(layout, first_value, value)
        rows = [_first_tensor(first_value).shape[dim], _first_tensor(value).shape[dim]]
        ratio = _patches_per_row(patch_counts, rows)
        if ratio is None:
            raise _refuse(tower, f"its output {field_name} has no fixed number of rows per patch on the grids {first} "
                          f"and {second}")
        count = len(value) if isinstance(value, (list, tuple)) else None
        width = tuple(_first_tensor(value).shape[dim + 1 :])
        outputs.append(OutputField(field_name, count, ratio, width, batched=bool(dim)))
    outputs.sort(key=lambda field: field.name != "pooler_output")  # flat outputs: the features a VLM reads first
    return _Verified(type(expected), tuple(outputs), relations, grid_traced)


PROBE_THREADS = 1
"""Intra-op threads of the probe forwards at most: their tensors are small (a second thread bought nothing on the
released-size Qwen towers), and processes that start together (data-parallel ranks, replicas) must not
oversubscribe the host's cores with them: two processes of two threads each on two cores learned Qwen3-VL's
interface 9x slower than one alone (``benchmarks/results/startup_interface_cpu.json``)."""


_PROBING = {"lock": threading.Lock(), "probes": 0, "threads": 0}
"""The probes running now, and the process's intra-op thread count from before the first of them."""


@contextlib.contextmanager
def _probe_threads() -> Iterator[None]:
    """At most ``PROBE_THREADS`` intra-op threads inside the block (a process-wide setting): the first of probes
    running at once on several threads lowers it, the last restores it."""
    with _PROBING["lock"]:
        if _PROBING["probes"] == 0:
            _PROBING["threads"] = torch.get_num_threads()
            torch.set_num_threads(min(_PROBING["threads"], PROBE_THREADS))
        _PROBING["probes"] += 1
    try:
        yield
    finally:
        with _PROBING["lock"]:
            _PROBING["probes"] -= 1
            if _PROBING["probes"] == 0:
                torch.set_num_threads(_PROBING["threads"])


def learn_packed_tower(tower: torch.nn.Module, probe: torch.nn.Module | None = None) -> PackedTower:
    """The tower's interface (see the module docstring); ``TowerRefused`` (a ``ValueError``) naming the reason when
    it cannot be served.

    The forwards run on a shrunk tower of the same class and config, on the host (``shrunk_tower``): the tower
    itself is never moved, copied or called (only when its class cannot be built from its config alone is it
    probed itself, where it is). ``probe``: the module the forwards run on instead (the tower itself, say).
    Each forward is counted (``counters.probe_forwards``).

    The plan is verified on a video and a one-merge-unit image; when that fails (the stock tower itself fails on
    more than one frame, or its rows do not scale with frames), on two images, and the tower serves images only,
    refusing grids with ``t > 1`` per call with the video's reason.
    """
    name = grid_argument(tower)
    extra = [
        parameter.name
        for parameter in list(inspect.signature(type(tower).forward).parameters.values())[2:]
        if parameter.name != name and parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    if extra:
        raise _refuse(tower, f"its forward takes {extra} besides the pixel rows and {name}")
    merge = _merge(tower.config) or 1
    first = [(1, 4 * merge, 8 * merge)]
    video = [(2, 2 * merge, 4 * merge), (1, merge, merge)]
    images = [(1, 2 * merge, 4 * merge), (1, merge, merge)]
    video_failure = None
    with _probe_threads():
        if probe is None:
            probe = shrunk_tower(tower)
        if probe is None:
            probe = tower
        with torch.no_grad(), routed_attention(probe):
            layout, plan, first_output = _record(probe, first)
            try:
                verified = _verify(probe, layout, plan, first, first_output, video)
            except TowerRefused as refusal:
                video_failure = str(refusal).split(": ", 1)[1]
                verified = _verify(probe, layout, plan, first, first_output, images)
    plan = plan.bound(tower.config)
    geometry = _geometry(tower, plan)
    return PackedTower(
        name, geometry, layout.shape, plan, verified.metadata_patches_per_row, verified.output_class,
        verified.outputs, video_failure, layout.batched, verified.grid_traced,
    )


def rows_per_unit(outputs: tuple[OutputField, ...]) -> tuple[int, list[int]]:
    """(patches per unit, each field's rows per unit): a unit is the coarsest field's row (a merged token)."""
    unit = math.lcm(*(field.patches_per_row for field in outputs))
    return unit, [unit // field.patches_per_row for field in outputs]
