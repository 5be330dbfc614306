"""``CompiledVisionTower``: a packed vision tower of any transformers family, served by vgraph bucket graphs.

Per call: check the inputs (before anything runs), pack the items into batches that fit the largest bucket,
take each batch's grid metadata from the cache (computed on the host once per distinct batch grid, by the plan
learned from the tower: ``packed_tower``; cached by ``grid_metadata``), run the compiled tower, and put every
item's rows back in the caller's order. On a tower served on images only, a grid row with t > 1 is refused by the
input check, before anything runs, with the reason its video failed.

Tier 1 of ``compile_vision_tower`` (``hf/vlm``): the whole forward, glue included, is one graph (``TowerCall``),
one replay per batch. Over a process group, each call is encoded data parallel, sequence parallel, or (``"auto"``)
planned per call from the grid (``parallel_tower``, ``parallel_plan``): every choice that decides which collectives
run is a pure function of the grid, the config and the group size, so the ranks never run different collectives.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import threading
from dataclasses import replace
from typing import Any, Callable, Literal

import torch

from vgraph_compile.analyze.bounds import BudgetRefused
from vgraph_compile.compile import artifacts
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import startup_phases
from vgraph_compile.entry.decorator import CompiledEncoderFunction
from vgraph_compile.hf.parallel import data_parallel, sequence_parallel
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.grid_metadata import Grid, GridMetadata
from vgraph_compile.hf.outputs import OutputFactory
from vgraph_compile.hf.interface.packed_tower import PackedTower, grid_argument, metadata_leaves
from vgraph_compile.hf.parallel.parallel_tower import ParallelTower
from vgraph_compile.hf.stand_in import TowerStandIn, TraceRefused
from vgraph_compile.hf.whole_graph.batching import Batch, pack, row_starts
from vgraph_compile.hf.whole_graph.tower_call import TowerCall, traced_window_offsets
from vgraph_compile.hf.interface.tower_interfaces import tower_interface

__all__ = ["CompiledVisionTower", "compile_packed_tower", "is_packed_tower"]

log = logging.getLogger(__name__)

Parallel = Literal["data", "sequence", "auto"]

_CHECKED_GRIDS = 4096
"""At most this many checked grids remembered (``_checked_grid``; cleared past it)."""
_MAX_ROWS = 2**31 - 1
"""The upper end of a metadata length's stated range (``_mark_sizes``): int32 offsets hold no more."""

def asks_nothing(defaults: dict[str, Any], name: str, value: Any) -> bool:
    """Whether passing ``name=value`` to a forward with these named parameters and defaults asks for what a call
    without it does: None, the named parameter's own default, or False for a flag taken through ``**kwargs`` (the
    transformers convention: an absent flag is off). Anything else may change the result, so the stock tower
    serves it."""
    if value is None:
        return True
    if name in defaults:
        default = defaults[name]
        return default is not inspect.Parameter.empty and type(value) is type(default) and value == default
    return value is False


class CompiledVisionTower(ParallelTower, TowerStandIn):
    """The tower, served by vgraph: ``(pixel_values, grid_thw) -> the tower's own output object``.

    It stands in the tower's place in a model (``model.model.visual = compile_packed_tower(model.model.visual)``):
    it shares the tower's parameter, buffer and submodule tables, so every name (``state_dict`` keys,
    ``named_parameters``) is the tower's own, and ``.to()``, ``eval()``, ``parameters()`` act on the tower's
    tensors. Attributes it does not define (``dtype``, ``spatial_merge_size``, ``config``, Qwen3's deepstack
    lists) are read from the tower. Calls with grad enabled, in training mode, or with keywords other than
    ``grid_thw`` / ``return_dict`` (e.g. precomputed metadata) run the stock tower with its own attention. A keyword
    that asks for what the traced call did is dropped (``asks_nothing``): None, the default of a parameter the
    tower's forward names, or False for a flag it only takes through ``**kwargs`` (a MoE model's
    ``output_router_logits=False``).

    With a ``process_group``, every rank of it must call with the same batch and every rank returns the whole
    output: each encodes its share of the items (``parallel="data"``: ``vgraph_compile.hf.parallel.data_parallel``), a
    slice of the rows (``"sequence"``: ``vgraph_compile.hf.parallel.sequence_parallel``), or per call the large items by
    rows and the rest by items (``"auto"``: ``vgraph_compile.hf.parallel.parallel_plan``; ``parallel_calls`` counts the
    modes). Set it to None to encode whole batches on this rank again. Call ``close()`` on every rank before
    ``destroy_process_group`` once a call went sequence parallel (its graphs hold the group's communicator).
    """

    def __init__(
        self,
        tower: torch.nn.Module,
        interface: PackedTower,
        config: VGraphConfig,
        metadata_cache_size: int = 1024,
        process_group: Any = None,
        parallel: Parallel = "data",
        sequence_cost: float = sequence_parallel.DEFAULT_SEQUENCE_COST,
        trace_refused: Callable[[str], torch.nn.Module] | None = None,
    ) -> None:
        super().__init__(tower)
        self.interface = interface
        self.trace_refused = trace_refused
        """What serves the tower when its whole forward cannot be traced as one graph (called with the reason):
        the block graphs, from ``compile_vision_tower``; None: the refusal is raised."""
        """What was learned from the tower: grid argument, pixel row shape, metadata plan, output fields."""
        self.signature = inspect.signature(tower.forward)
        """The tower's forward signature: calls bind to it, by position or by the tower's own names."""
        self.defaults = {
            name: parameter.default
            for name, parameter in self.signature.parameters.items()
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
        }
        """The tower's forward parameters by name, with their defaults (``inspect.Parameter.empty`` where none)."""
        self.pixel_argument = next(iter(self.defaults))
        """The forward's pixel rows argument (``hidden_states``, ``pixel_values``...): its first."""
        self.grid_second = list(self.defaults)[1:2] == [interface.grid_argument]
        """Whether the grid is the forward's second parameter (a call ``tower(pixels, grid)`` passes just those)."""
        self.vgraph_config = config
        self.geometry = config.geometry
        self.grid_metadata = GridMetadata(tower, interface, metadata_cache_size, grid_rows=config.max_frames + 1)
        self.split_calls = 0
        self.stock_calls = 0
        self.process_group = process_group
        """A ``torch.distributed`` process group to encode over; None: this rank alone."""
        if parallel not in ("data", "sequence", "auto"):
            raise ValueError(f"parallel={parallel!r}: choose 'data', 'sequence' or 'auto'")
        if parallel == "sequence" and self.sequence_refusal:
            raise ValueError(f"parallel='sequence': {self.sequence_refusal}; use parallel='data'")
        self.parallel = parallel
        self.sequence_cost = sequence_cost
        """``parallel="auto"``: what a sequence-parallel row costs in data-parallel rows (``parallel_plan``)."""
        self.parallel_calls: collections.Counter[str] = collections.Counter()
        """Calls over the process group per mode ("data", "sequence", "sequence+data": some items each way)."""
        self.load_stats = data_parallel.LoadStats()
        self.make_output = OutputFactory(interface.output_class)
        """Builds the tower's output object from its fields (``hf/outputs``)."""
        self._reset()

    def _reset(self) -> None:
        """A fresh vgraph encoder (traced on its first call) and an empty metadata cache; sequence-parallel graphs
        are released first (they hold the process group's communicator)."""
        if self.__dict__.get("sequence_graphs") is not None:
            self.close()
        config = replace(self.vgraph_config, window_offsets=traced_window_offsets(self.vgraph_config))
        self.__dict__["compiled"] = self._encoder(config)
        self.__dict__["parameter"] = next(self.tower.parameters())
        """A parameter of the tower: its device and dtype are what inputs must have (read once per compile)."""
        self.__dict__["sequence_graphs"] = None
        """The sequence-parallel trace (``_SequenceGraphs``), made at the first sequence-parallel call."""
        self.__dict__["_warmup_lock"] = threading.Lock()
        self.__dict__["_checked_grids"] = {}
        """Grid (tuple of rows) -> (its rows as a list, its patch count), for the grids ``_checked_grid`` passed."""
        self.grid_metadata.clear()

    def _encoder(
        self, config: VGraphConfig, agree_buckets: Callable[[set[int]], set[int]] | None = None
    ) -> CompiledEncoderFunction:
        """The tower's traced call compiled by vgraph; every trace of it, the first or a retrace for a call that
        the first trace does not cover, sees the attention routed, whichever blocks the tower has.
        ``agree_buckets``: its runtimes' (``VGraphRuntime.agree_buckets``)."""
        call = TowerCall(self.tower, self.interface)
        return CompiledEncoderFunction(
            call, config, around_trace=lambda: routed_attention(self.tower), agree_buckets=agree_buckets
        )

    def _runtimes(self) -> list:
        """One per dynamo trace; normally one."""
        return self.compiled.vgraph.runtimes

    def _stats_table(self) -> str:
        """The tier, and each runtime's buckets (the sequence trace's too); with data-parallel calls, each rank's
        load and the imbalance; with calls over a process group, the calls per mode."""
        tables = ["tier: whole-tower graph", *(runtime.stats_table() for runtime in self.runtimes)]
        if self.sequence_graphs is not None:
            tables.append("sequence parallel:")
            tables.extend(runtime.stats_table() for runtime in self.sequence_graphs.compiled.vgraph.runtimes)
        if self.load_stats.calls:
            rank = torch.distributed.get_rank(self.process_group) if self.process_group is not None else "-"
            tables.append(self.load_stats.table(rank))
        if self.parallel_calls:
            modes = ", ".join(f"{mode} {count}" for mode, count in sorted(self.parallel_calls.items()))
            tables.append(f"calls over the process group ({self.parallel}): {modes}")
        return "\n".join(tables)

    # -- checks ------------------------------------------------------------------------------------------------
    def _check(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """(the pixel rows packed along dim 0, the grid), or a ValueError in the tower's argument names."""
        pixels, grid_name = self.pixel_argument, self.interface.grid_argument
        if not isinstance(pixel_values, torch.Tensor):
            raise ValueError(f"{pixels} must be a torch.Tensor, got {type(pixel_values).__name__}")
        if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(
                f"{grid_name} must be a [items, 3] tensor of (t, h, w), got {getattr(grid_thw, 'shape', grid_thw)}"
            )
        if grid_thw.is_floating_point():
            raise ValueError(f"{grid_name} must hold integers, got {grid_thw.dtype}")
        grid, rows = self._checked_grid(grid_thw)
        shape = self.interface.pixel_shape
        leading = (1,) if self.interface.batched else ()
        dims = tuple(pixel_values.shape)
        if dims[: len(leading)] != leading or dims[len(leading) + 1 :] != shape:
            raise ValueError(
                f"{pixels} must be [{'1, ' * len(leading)}patches, {', '.join(map(str, shape))}] (the processor's "
                f"patch rows), got {tuple(pixel_values.shape)}"
            )
        if pixel_values.shape[len(leading)] != rows:
            raise ValueError(
                f"{pixels} has {pixel_values.shape[len(leading)]} rows but {grid_name} describes sum(t*h*w) = {rows} "
                "patches: pass the pixel_values and image_grid_thw/video_grid_thw of the same processor call"
            )
        parameter = self.parameter
        if pixel_values.device != parameter.device or pixel_values.dtype != parameter.dtype:
            raise ValueError(
                f"{pixels} is {pixel_values.dtype} on {pixel_values.device} but the tower is {parameter.dtype} "
                f"on {parameter.device}: convert with {pixels}.to(tower.device, tower.dtype)"
            )
        return (pixel_values[0] if leading else pixel_values), grid

    def _checked_grid(self, grid_thw: torch.Tensor) -> tuple[list[tuple[int, int, int]], int]:
        """(the grid's rows as (t, h, w) ints, its patch count), or a ValueError; each distinct grid is checked once
        (``_checked_grids``, bounded), its later calls take the list and count kept then (never changed in place)."""
        values = grid_thw.tolist()
        checked = self._checked_grids.get(tuple(map(tuple, values)))
        if checked is not None:
            return checked
        grid = [tuple(int(v) for v in row) for row in values]
        grid_name = self.interface.grid_argument
        merge = self.geometry.spatial_merge_size
        for index, (t, h, w) in enumerate(grid):
            if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
                raise ValueError(
                    f"{grid_name}[{index}] = {(t, h, w)}: t, h, w must be positive and h, w multiples of the spatial "
                    f"merge size {merge} (the image processor resizes images to that)"
                )
        video_failure = self.interface.video_failure
        videos = [index for index, (t, _, _) in enumerate(grid) if t > 1]
        if videos and video_failure:
            raise ValueError(
                f"{grid_name}[{videos[0]}] = {grid[videos[0]]} has {grid[videos[0]][0]} frames, but "
                f"{type(self.tower).__name__} serves images only (t = 1): {video_failure}. Pass videos one frame per "
                "row, as its model's get_video_features does"
            )
        checked = grid, sum(t * h * w for t, h, w in grid)
        if len(self._checked_grids) >= _CHECKED_GRIDS:
            self._checked_grids.clear()
        self._checked_grids[tuple(grid)] = checked
        return checked

    # -- per call ----------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Trace, compile once and capture every bucket with a synthetic image, before serving any call (and return
        once every graph is captured: ``capture_all``); once the trace is refused, the module serving the tower
        instead (``trace_refused``'s block graphs) records and compiles on that image.

        The image is one window tall (one merge unit without windows) and as many wide as the smallest budget
        holds, at least two: both attention groups (frames and windows) have segments in the trace, and a size
        guard the trace keeps (a convolution's backend choice for a batch under 16 rows) is one that holds at the
        sizes of the buckets, not at a toy size below them. Which group is the window group comes from
        ``VGraphConfig.window_offsets`` (the tower's ``cu_window_seqlens``), not from the image. Later calls skip
        dynamo, in any grad mode.
        """
        try:
            self._warm_up()
        except TraceRefused:
            if not self.replacement.runtimes:
                pixel_values, grid = self._synthetic_image()
                arguments = {self.pixel_argument: pixel_values, self.interface.grid_argument: torch.tensor(grid)}
                with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
                    self.replacement(**arguments)
        self.capture_all()

    def _synthetic_image(self) -> tuple[torch.Tensor, Grid]:
        """The warm-up's image (``warmup``): its pixel rows on the tower's device and dtype, and its grid."""
        side = self.geometry.spatial_merge_size * (self.geometry.merged_window or 1)
        wide = max(2, self.vgraph_config.budgets[0] // (side * side))
        grid = ((1, side, wide * side),)
        return self._random_pixels(grid), grid

    def _random_pixels(self, grid: Grid) -> torch.Tensor:
        """Random pixel rows of ``grid``, on the tower's device and in its dtype (for the warm-up calls)."""
        rows = sum(t * h * w for t, h, w in grid)
        parameter = self.parameter
        return torch.randn((rows, *self.interface.pixel_shape), device=parameter.device, dtype=parameter.dtype)

    def _warm_up(self) -> None:
        """The whole-tower trace made once, however many threads make their first call at once; ``TraceRefused``
        once it is refused (the replacement serves). A warmed tower returns without the lock (every call asks)."""
        if self.replacement is None and self.compiled.vgraph.runtimes:
            return
        with self._warmup_lock:
            if self.replacement is not None:
                raise TraceRefused
            if self.compiled.vgraph.runtimes:
                return
            pixel_values, grid = self._synthetic_image()
            try:
                with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
                    self._run(pixel_values, grid)
            except BudgetRefused:  # the caller's token_budgets, not the tower: said as it is, before any compile
                raise
            except ValueError as refusal:  # the whole forward is not one graph (the input is ours)
                if self.trace_refused is None:
                    raise
                self.hand_down(self.trace_refused, str(refusal))
                raise TraceRefused(refusal) from refusal

    def _run(self, pixel_values: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, ...]:
        """The compiled tower on one batch, keyed by its grid: the metadata is the grid's, from the cache."""
        metadata = self.grid_metadata(grid, pixel_values.device)
        if not self.compiled.traced:
            self._mark_sizes(metadata)
        return self.compiled.call_keyed(grid, pixel_values, **metadata)

    def _mark_sizes(self, metadata: dict[str, Any]) -> None:
        """Before the trace: a grid table's rows are one size for every call (static), and every other metadata
        tensor whose length is not tied to the patch count (offsets: one entry per segment, plus one) has at least
        one row. Without that bound, torch 2.11's inductor cannot size a slice of it under size-oblivious tracing
        (``cu_seqlens[1:]`` in a tower's own code) and fails to lower it."""
        for key, value in metadata.items():
            if key == self.interface.grid_argument:
                torch._dynamo.mark_static(value, 0)
                continue
            for part, leaf in enumerate(metadata_leaves(value)):
                if not isinstance(leaf, torch.Tensor) or not leaf.dim():
                    continue
                if (key, part) not in self.interface.metadata_patches_per_row:
                    torch._dynamo.mark_dynamic(leaf, 0, min=1, max=_MAX_ROWS)

    def forward(self, *args: Any, **kwargs: Any):
        """The tower's own arguments, by position or by its names (the processor's pixel rows as
        ``hidden_states`` or ``pixel_values``, the grid as ``grid_thw``...); once the trace was refused, the
        ``trace_refused`` module serves every call, after the same input checks (``_check``)."""
        if self.replacement is None:
            try:
                return self._forward(*args, **kwargs)
            except TraceRefused:
                pass
        if not self.training and not torch.is_grad_enabled():
            arguments = self._bound(args, kwargs)
            self._check(arguments[self.pixel_argument], arguments.get(self.interface.grid_argument))
        return self.replacement(*args, **kwargs)

    def _bound(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by the tower's parameter names, or a ValueError naming its signature."""
        try:
            return dict(self.signature.bind(*args, **kwargs).arguments)
        except TypeError as error:
            raise ValueError(f"{type(self.tower).__name__}.forward{self.signature}: {error}") from None

    def _forward(self, *args: Any, **kwargs: Any):
        """A call of the pixels and the grid alone (by position, or the grid by its name) is bound without
        ``inspect``."""
        grid_name = self.interface.grid_argument
        if not self.training and not torch.is_grad_enabled():
            if len(args) == 2 and not kwargs and self.grid_second:
                return self._serve(*args)
            if len(args) == 1 and len(kwargs) == 1 and grid_name in kwargs:
                return self._serve(args[0], kwargs[grid_name])
        arguments = self._bound(args, kwargs)
        pixel_values = arguments.pop(self.pixel_argument)
        grid_thw = arguments.pop(self.interface.grid_argument, None)
        options = {}
        for name, value in arguments.items():
            kind = self.signature.parameters[name].kind
            options.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
        return_dict = options.pop("return_dict", True)
        options = {name: value for name, value in options.items() if not asks_nothing(self.defaults, name, value)}
        if options or self.training or torch.is_grad_enabled():
            self.stock_calls += 1
            if options:
                log.debug("keywords %s: the stock tower serves this call", sorted(options))
            return self.tower(*args, **kwargs)
        out = self._serve(pixel_values, grid_thw)
        return out if return_dict else out.to_tuple()

    def _serve(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        if self.process_group is not None:
            return self._serve_parallel(pixel_values, grid_thw)
        pixel_values, grid = self._check(pixel_values, grid_thw)
        self._warm_up()
        return self._output(self._encode(pixel_values, grid))

    def _encode(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The flat output fields of the checked items, on this rank."""
        if not grid:
            return [
                pixel_values.new_empty(0, *field.width)
                for field in self.interface.outputs
                for _ in range(field.tensors)
            ]
        config = self.vgraph_config
        batches = pack(grid, config.budgets[-1], config.max_items, config.max_frames)
        if len(batches) == 1 and not batches[0].eager:  # one graph call holds it all: keep the caller's order
            return list(self._run(pixel_values, tuple(grid)))
        self.split_calls += 1
        return self._split(pixel_values, grid, batches)


    def _split(self, pixel_values, grid, batches: list[Batch]) -> list[torch.Tensor]:
        """Each batch's flat outputs, put back per item in the caller's order. A window permutation (Qwen2.5-VL's)
        keeps each item's rows together, in item order, so ``last_hidden_state`` comes out as one call gives it."""
        starts = row_starts(grid)
        parts = []
        for batch in batches:
            rows = torch.cat([pixel_values[starts[i] : starts[i + 1]] for i in batch.items])
            parts.append((batch.items, self._run(rows, tuple(grid[i] for i in batch.items))))
        return self._merge(grid, parts)

    def _merge(self, grid, parts) -> list[torch.Tensor]:
        """The flat output fields of every item in the caller's order, from ``parts``: (items, their flat outputs,
        each item's rows after the previous item's, in the order listed). One part listing every item in order is
        returned as it is."""
        if len(parts) == 1 and list(parts[0][0]) == list(range(len(grid))):
            return list(parts[0][1])
        starts = row_starts(grid)
        per_row = [field.patches_per_row for field in self.interface.outputs for _ in range(field.tensors)]
        pieces: list[list[Any]] = [[None] * len(grid) for _ in per_row]
        for items, outputs in parts:
            offset = 0
            for index in items:
                size = starts[index + 1] - starts[index]
                for flat, output in enumerate(outputs):
                    pieces[flat][index] = output[offset // per_row[flat] : (offset + size) // per_row[flat]]
                offset += size
        return [torch.cat(field) for field in pieces]

    def _output(self, flat: list[torch.Tensor]):
        """The tower's own output object from the flat fields (a batched field gets its leading dim of 1 back)."""
        fields, position = {}, 0
        for field in self.interface.outputs:
            values = flat[position : position + field.tensors]
            values = [value[None] if field.batched else value for value in values]
            fields[field.name] = values[0] if field.count is None else values
            position += field.tensors
        return self.make_output(fields)


def is_packed_tower(tower: torch.nn.Module) -> bool:
    """Whether ``tower`` takes packed patch rows with a grid (``grid_thw``, ``image_grid_thw``...) and a config."""
    return isinstance(tower, torch.nn.Module) and hasattr(tower, "config") and grid_argument(tower) is not None


def compile_packed_tower(
    tower: torch.nn.Module,
    token_budgets: list[int] | tuple[int, ...] | None = None,
    max_items: int = 8,
    max_frames: int | None = None,
    process_group: Any = None,
    parallel: Parallel = "data",
    sequence_cost: float = sequence_parallel.DEFAULT_SEQUENCE_COST,
    trace_refused: Callable[[str], torch.nn.Module] | None = None,
    **options: Any,
) -> CompiledVisionTower:
    """Compile a packed tower (``model.visual``: its forward takes a grid) with the vgraph backend, bounded by the
    tower's own geometry.

    ``token_budgets`` count patches (rows of pixel_values; multiples of spatial_merge_size^2); ``max_items`` and
    ``max_frames`` (temporal patches of all items; default max(max_items, 16)) bound one graph call, and larger
    calls are split. Other ``options`` are ``VGraphConfig`` fields; ``check_values`` defaults to False here, since
    the offsets are built from the checked ``grid_thw`` (so no call reads device data back). Returns a module
    that can replace the tower in its model; while it is in training mode the stock tower serves it.

    ``process_group`` (a ``torch.distributed`` group, NCCL or gloo): encode over its ranks. Every rank calls with
    the same full batch and gets the full output, equal to a single-process call. ``parallel``: ``"data"``, each
    rank encodes a share of the items balanced by patches (``vgraph_compile.hf.parallel.data_parallel``); ``"sequence"``,
    each encodes a slice of the packed rows, its full attention spanning the ranks
    (``vgraph_compile.hf.parallel.sequence_parallel``); ``"auto"``, per call, the items too large for a rank's fair share
    sequence parallel (a row of it costing ``sequence_cost`` rows) and the rest data parallel
    (``vgraph_compile.hf.parallel.parallel_plan``). None: this process alone. With ``"sequence"`` or ``"auto"``, call the
    tower's ``close()`` on every rank before ``destroy_process_group``.

    ``trace_refused``: called with the reason when the first call's warm-up trace is refused (the whole forward is
    not one graph); the module it returns serves that call and every later one (``compile_vision_tower`` passes
    the block graphs).
    """
    if isinstance(tower, CompiledVisionTower):
        tower = tower.tower
    if not is_packed_tower(tower):
        raise ValueError(
            f"{type(tower).__name__} is not a vision tower vgraph can serve: its forward takes no grid "
            "(grid_thw, image_grid_thw...) of packed variable-size images. Pass the vision tower of a transformers "
            "VLM (model.visual, model.vision_tower...), or compile a custom encoder with vgraph_compile.encoder"
        )
    with startup_phases.phase("interface"):
        interface = tower_interface(tower, artifacts.configured_dir(options.get("artifact_dir")))
    log.info("%s: grid metadata %s", type(tower).__name__, interface.metadata.describe())
    config = VGraphConfig(
        token_budgets=tuple(token_budgets) if token_budgets is not None else None,
        geometry=interface.geometry,
        max_items=max_items,
        max_frames=max(max_items, 16) if max_frames is None else max_frames,
        max_segments=options.pop("max_segments", max_items),
        check_values=options.pop("check_values", False),
        **options,
    )
    return CompiledVisionTower(
        tower,
        interface,
        config,
        process_group=process_group,
        parallel=parallel,
        sequence_cost=sequence_cost,
        trace_refused=trace_refused,
    )
