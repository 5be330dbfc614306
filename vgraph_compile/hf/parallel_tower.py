"""The parallel modes of the whole-tower graph: per call over a process group, every rank checks that all got the
same batch, and encodes either a share of the items (``parallel="data"``: ``data_parallel``) or a slice of the
packed rows through a second trace of the tower whose full attention spans the ranks (``"sequence"``:
``sequence_parallel``); ``"auto"`` chooses per call (``sequence_parallel.choose``). Everyone's outputs are
gathered, so every rank returns the whole output.

``ParallelTower`` holds that orchestration for ``CompiledVisionTower`` (``whole_tower``), which serves one
process's calls and keeps the state these methods read: ``process_group``, ``parallel``, ``sequence_cost``,
``parallel_calls``, ``load_stats``, ``sequence_graphs``, and the per-call steps ``_check``, ``_encode``,
``_output``, ``_routing`` and ``warmup``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from vgraph_compile.decorator import encoder
from vgraph_compile.hf import data_parallel, sequence_parallel
from vgraph_compile.hf.grid_metadata import Grid, GridMetadata
from vgraph_compile.hf.packed_tower import rows_per_unit
from vgraph_compile.hf.packing import row_starts
from vgraph_compile.hf.tower_call import TowerCall, traced_window_offsets

__all__ = ["ParallelTower"]


@dataclass(frozen=True)
class _SequenceGraphs:
    """The tower's sequence-parallel trace over one process group, and its per-rank grid metadata."""

    group: Any
    rank: int
    ranks: int
    compiled: Any
    grid_metadata: GridMetadata


class ParallelTower:
    """Per-call data- and sequence-parallel encoding over a process group (see the module docstring)."""

    def _serve_parallel(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Every rank checks that all got the same batch, encodes its share (items or rows, by ``parallel``), and
        gathers everyone's outputs."""
        group = self.process_group
        try:
            (pixel_values, grid), refused = self._check(pixel_values, grid_thw), None
        except ValueError as error:
            grid, refused = [], error
        key = data_parallel.REFUSED if refused else data_parallel.grid_hash(grid)
        agreed = data_parallel.same_batch(key, group, self.parameter.device)
        if refused:
            raise refused
        if not agreed:
            raise ValueError(
                "the ranks of process_group were called with different grid_thw (or another rank refused its "
                "input): every rank must pass the same full batch (pixel_values, grid_thw), as tensor-parallel "
                "ranks receive the same multimodal inputs"
            )
        rank, ranks = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        mode = self.parallel
        if mode == "sequence" and self.sequence_refusal:
            raise ValueError(f"parallel='sequence': {self.sequence_refusal}; use parallel='data'")
        if grid and ranks > 1 and mode != "data" and not self.sequence_refusal:
            split = self._row_split(tuple(grid), ranks)
            if mode == "auto":
                mode = sequence_parallel.choose(grid, split, self.sequence_cost)
            if mode == "sequence":
                self.parallel_calls[mode] += 1
                return self._output(self._encode_sequence(pixel_values, split, self._sequence_graphs()))
        self.parallel_calls["data"] += 1
        self.warmup()
        assignment = data_parallel.assign(grid, ranks)
        self.load_stats.record(assignment)
        if not grid:
            return self._output(self._encode(pixel_values, grid))
        mine = assignment.items[rank]
        starts = row_starts(grid)
        rows = [pixel_values[starts[i] : starts[i + 1]] for i in mine]
        local = self._encode(torch.cat(rows) if rows else pixel_values[:0], [grid[i] for i in mine])
        unit, folds = rows_per_unit(self.interface.outputs)
        units = [(starts[i + 1] - starts[i]) // unit for i in range(len(grid))]
        flat_folds = [fold for field, fold in zip(self.interface.outputs, folds) for _ in range(field.count or 1)]
        return self._output(data_parallel.gather(local, flat_folds, units, assignment, rank, group))

    # -- sequence parallel --------------------------------------------------------------------------------------
    @property
    def sequence_refusal(self) -> str | None:
        """Why this tower cannot be encoded sequence parallel (None: it can). A rank's slice is rows of a
        ``[patches, ...]`` pixel layout, and the sliced metadata is the learned plan's; a grid table read in the
        graph is indexed by segment, which a slice does not renumber."""
        if self.interface.batched:
            return f"{type(self.tower).__name__} takes pixel_values with a leading batch dim"
        if self.interface.grid_traced:
            return f"{type(self.tower).__name__} reads {self.interface.grid_argument} inside its graph"
        return None

    def _row_split(self, grid: Grid, ranks: int) -> sequence_parallel.Split:
        unit, _ = rows_per_unit(self.interface.outputs)
        return sequence_parallel.split_rows(grid, self.geometry, ranks, unit)

    def _sequence_graphs(self) -> _SequenceGraphs:
        """The sequence trace over the current process group; made, and warmed up on every rank at once (each rank
        one synthetic image of 2 x 2 windows), at the group's first sequence-parallel call."""
        group = self.process_group
        if self.sequence_graphs is not None and self.sequence_graphs.group is group:
            return self.sequence_graphs
        rank, ranks = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        window_keys = self.vgraph_config.window_offsets
        window_inputs = traced_window_offsets(self.vgraph_config)
        config = sequence_parallel.sequence_config(self.vgraph_config, group.group_name, ranks, window_inputs)

        def localize(grid: Grid, metadata: dict[str, Any]) -> dict[str, Any]:
            relations = self.interface.metadata_patches_per_row
            split = self._row_split(grid, ranks)
            return sequence_parallel.localize(metadata, relations, window_keys, split, rank)

        graphs = _SequenceGraphs(
            group,
            rank,
            ranks,
            encoder(TowerCall(self.tower, self.interface), config=config),
            GridMetadata(self.tower, self.interface, self.grid_metadata.size, localize=localize),
        )
        self.__dict__["sequence_graphs"] = graphs
        side = 2 * self.geometry.spatial_merge_size * (self.geometry.merged_window or 1)
        grid = ((1, side, side),) * ranks
        parameter = self.parameter
        shape = (ranks * side * side, *self.interface.pixel_shape)
        pixel_values = torch.randn(shape, device=parameter.device, dtype=parameter.dtype)
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            self._encode_sequence(pixel_values, self._row_split(grid, ranks), graphs)
        return graphs

    def _encode_sequence(
        self, pixel_values: torch.Tensor, split: sequence_parallel.Split, graphs: _SequenceGraphs
    ) -> list[torch.Tensor]:
        """The flat output fields of the whole batch, this rank encoding its slice of the rows."""
        start, stop = split.rows(graphs.rank)
        padding = pixel_values.new_zeros(split.slice_rows - (stop - start), *pixel_values.shape[1:])
        rows = torch.cat([pixel_values[start:stop], padding])  # a new tensor: the graphs pin a view's offset
        with self._routing(graphs.compiled):
            local = graphs.compiled(rows, **graphs.grid_metadata(split.grid, pixel_values.device))
        unit, folds = rows_per_unit(self.interface.outputs)
        flat_folds = [fold for field, fold in zip(self.interface.outputs, folds) for _ in range(field.count or 1)]
        return sequence_parallel.gather(list(local), flat_folds, unit, split, graphs.rank, graphs.group)
