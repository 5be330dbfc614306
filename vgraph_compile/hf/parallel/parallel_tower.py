"""The parallel modes of the whole-tower graph: per call over a process group, every rank checks that all got the
same batch, and encodes either a share of the items (``parallel="data"``: ``data_parallel``) or a slice of the
packed rows through a second trace of the tower whose full attention spans the ranks (``"sequence"``:
``sequence_parallel``); ``"auto"`` plans per call from the grid alone (``parallel_plan``: the items too large for
a rank's fair share by sequence, the rest by data). Everyone's outputs are gathered, so every rank returns the
whole output. Towers whose graphs hold collectives must be ``close()``d on every rank before
``destroy_process_group``.

``ParallelTower`` holds that orchestration for ``CompiledVisionTower`` (``whole_tower``), which serves one
process's calls and keeps the state these methods read: ``process_group``, ``parallel``, ``sequence_cost``,
``parallel_calls``, ``load_stats``, ``sequence_graphs``, and the per-call steps ``_check``, ``_encode``,
``_output``, ``_encoder`` and ``warmup``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from vgraph_compile.hf.parallel import data_parallel, parallel_plan, rank_agreement, sequence_parallel
from vgraph_compile.hf.interface.grid_metadata import Grid, GridMetadata
from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.packed_tower import metadata_leaves, rows_per_unit
from vgraph_compile.hf.stand_in import TraceRefused
from vgraph_compile.hf.whole_graph.batching import row_starts
from vgraph_compile.hf.whole_graph.tower_call import traced_window_offsets

__all__ = ["ParallelTower"]


def _item_rows(pixel_values: torch.Tensor, starts: list[int], items, count: int) -> torch.Tensor:
    """The pixel rows of ``items`` (ascending indices, of ``count`` items), one after another."""
    if list(items) == list(range(count)):
        return pixel_values
    rows = [pixel_values[starts[i] : starts[i + 1]] for i in items]
    return torch.cat(rows) if rows else pixel_values[:0]


def _same_value(a: Any, b: Any) -> bool:
    """Equal metadata parts: tensors of one dtype and shape with equal values, or equal plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


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
        """Every rank checks that all got the same batch, plans the call (``_plan``: a pure function of the grid, so
        every rank runs the same collectives), encodes its share of the data-parallel items and cuts its slice of
        the sequence-parallel items' rows, agrees that every rank succeeded, runs the sequence graphs (their
        all-to-alls span the ranks), agrees again, and gathers everyone's outputs. A rank whose work raised makes
        every rank raise at the next agreement (``rank_agreement.agree_on_success``), so none is left in a
        collective the others skipped.

        The first call traces and captures the local graphs before anything else (``_first_warm_up``; not under
        ``parallel="sequence"``, which needs none)."""
        group = self.process_group
        checks = rank_agreement.check_group(group, self.parameter.device)
        try:
            (pixel_values, grid), refused = self._check(pixel_values, grid_thw), None
        except Exception as error:  # whatever one rank's input raises, every rank learns it refused, and raises
            grid, refused = [], error
        key = rank_agreement.REFUSED if refused else rank_agreement.grid_hash(grid)
        cold = self.parallel != "sequence" and not self.compiled.vgraph.runtimes
        agreed, some_cold = rank_agreement.same_batch(key, *checks, cold=cold)
        if refused:
            raise refused
        if not agreed:
            raise ValueError(
                "the ranks of process_group were called with different grid_thw (or another rank refused its "
                "input): every rank must pass the same full batch (pixel_values, grid_thw), as tensor-parallel "
                "ranks receive the same multimodal inputs"
            )
        rank, ranks = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        if self.parallel == "sequence" and self.sequence_refusal:
            raise ValueError(f"parallel='sequence': {self.sequence_refusal}; use parallel='data'")
        if some_cold:  # on every rank alike, whichever warmed up already
            self._first_warm_up(checks)
        if self.parallel != "sequence" and self.frames_split_exactly:
            grid = list(parallel_plan.split_frames(grid, ranks))  # the same rows: the outputs are the same
        plan = self._plan(grid, ranks)
        self.parallel_calls[plan.mode] += 1
        self.load_stats.record(plan.assignment)
        if not grid:
            self._warm_up()
            return self._output(self._encode(pixel_values, grid))
        starts = row_starts(grid)
        graphs = self._sequence_graphs() if plan.sequence else None
        split = self._row_split(tuple(grid[i] for i in plan.sequence), ranks) if plan.sequence else None
        failure = local = sliced = None
        try:
            if plan.data:
                self._warm_up()
                mine = [plan.data[i] for i in plan.assignment.items[rank]]
                local = self._encode(_item_rows(pixel_values, starts, mine, len(grid)), [grid[i] for i in mine])
            if plan.sequence:
                rows = _item_rows(pixel_values, starts, plan.sequence, len(grid))
                sliced = self._sequence_slice(rows, split, graphs)
        except Exception as error:  # this rank's own work: every rank raises at the agreement, before a collective
            failure = error
        rank_agreement.agree_on_success(failure, *checks)
        parts = []
        if plan.sequence:
            try:
                encoded = graphs.compiled(sliced[0], **sliced[1])
            except Exception as error:  # after the last all-to-all: the others wait at the agreement, not the gather
                failure = error
            rank_agreement.agree_on_success(failure, *checks)
            parts.append((plan.sequence, self._gather_sequence(list(encoded), split, graphs)))
        if plan.data:
            unit, _ = rows_per_unit(self.interface.outputs)
            units = [(starts[i + 1] - starts[i]) // unit for i in plan.data]
            gathered = data_parallel.gather(local, self._flat_folds(), units, plan.assignment, rank, group)
            parts.append((plan.data, gathered))
        return self._output(self._merge(grid, parts))

    def _flat_folds(self) -> list[int]:
        """Rows per merged unit of each flat output field (``data_parallel.gather``'s ``folds``)."""
        _, folds = rows_per_unit(self.interface.outputs)
        return [fold for field, fold in zip(self.interface.outputs, folds) for _ in range(field.tensors)]

    def _first_warm_up(self, checks: tuple) -> None:
        """The local graphs traced and captured, at the first call, before any other collective of it. A tower
        whose whole forward is not one graph is refused alike on every rank (the same tower, options and synthetic
        image): every rank hands it down here (``TraceRefused``), and the module below (block graphs, which encode
        each call whole on every rank) serves it. Any other failure of one rank's warm-up makes every rank raise
        (``rank_agreement.agree_on_success``), so none waits in a collective the others skipped. Every rank comes
        here when some rank has no runtime yet (``rank_agreement.same_batch``'s flag): after one rank's warm-up
        failed alone, the others, warmed, take this agreement with it, where skipping it would pair their next
        collective with it."""
        failure = None
        try:
            self._warm_up()
        except TraceRefused:
            raise
        except Exception as error:
            failure = error
        rank_agreement.agree_on_success(failure, *checks)

    def _plan(self, grid: list[tuple[int, int, int]], ranks: int) -> parallel_plan.ParallelPlan:
        """Which items go sequence parallel, which data parallel and where: from ``parallel``, the grid and the
        ranks alone (``parallel_plan``). ``"auto"`` plans per call; a tower a slice cannot serve goes data parallel."""
        def slice_rows(sub_grid) -> int:
            return self._row_split(sub_grid, ranks).slice_rows

        mode = self.parallel
        if mode == "auto" and grid and ranks > 1 and not self.sequence_refusal:
            return parallel_plan.plan(grid, ranks, slice_rows, self.sequence_cost)
        sequence = tuple(range(len(grid))) if mode == "sequence" and ranks > 1 else ()
        cost, data, assignment = parallel_plan.plan_cost(grid, sequence, ranks, slice_rows, self.sequence_cost)
        return parallel_plan.ParallelPlan(sequence, data, assignment, cost)

    @functools.cached_property
    def frames_split_exactly(self) -> bool:
        """Whether a video's frames may be encoded as items of their own (``parallel_plan.split_frames``): the
        grid metadata of one two-frame item equals that of its two frames as two items. The traced call sees the
        pixel rows and that metadata only (not the grid), so the outputs are then the same rows. Not for a tower
        that reads its grid in the graph, or serves images only."""
        if self.interface.grid_traced or self.interface.video_failure:
            return False
        side = self.geometry.spatial_merge_size * (self.geometry.merged_window or 1)
        with torch.inference_mode(False), routed_attention(self.tower):
            video = self.interface.metadata.compute(torch.tensor([[2, side, 2 * side]]))
            frames = self.interface.metadata.compute(torch.tensor([[1, side, 2 * side]] * 2))
        if video.keys() != frames.keys():
            return False
        for key in video:
            mine, theirs = metadata_leaves(video[key]), metadata_leaves(frames[key])
            if len(mine) != len(theirs) or not all(map(_same_value, mine, theirs)):
                return False
        return True

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
        one synthetic image of 2 x 2 windows), at the group's first sequence-parallel call. Its runtimes serve no
        call, the warm-up included, before the ranks agree on the buckets every one captured
        (``rank_agreement.common_budgets``): the graphs hold the all-to-alls, so every rank must replay the same."""
        group = self.process_group
        if self.sequence_graphs is not None and self.sequence_graphs.group is group:
            return self.sequence_graphs
        self.close()
        rank, ranks = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        window_keys = self.vgraph_config.window_offsets
        window_inputs = traced_window_offsets(self.vgraph_config)
        config = sequence_parallel.sequence_config(self.vgraph_config, group.group_name, ranks, window_inputs)
        checks, device = rank_agreement.check_group(group, self.parameter.device)

        def agree(held: set[int]) -> set[int]:
            return rank_agreement.common_budgets(held, self.vgraph_config.budgets, checks, device)

        def localize(grid: Grid, metadata: dict[str, Any]) -> dict[str, Any]:
            relations = self.interface.metadata_patches_per_row
            split = self._row_split(grid, ranks)
            return sequence_parallel.localize(metadata, relations, window_keys, split, rank)

        graphs = _SequenceGraphs(
            group,
            rank,
            ranks,
            self._encoder(config, agree_buckets=agree),
            GridMetadata(self.tower, self.interface, self.grid_metadata.size, localize=localize),
        )
        self.__dict__["sequence_graphs"] = graphs
        side = 2 * self.geometry.spatial_merge_size * (self.geometry.merged_window or 1)
        grid = ((1, side, side),) * ranks
        rows, metadata = self._sequence_slice(self._random_pixels(grid), self._row_split(grid, ranks), graphs)
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            graphs.compiled(rows, **metadata)
        return graphs

    def close(self) -> None:
        """Release the sequence-parallel graphs: their captured all-to-alls hold the process group's NCCL
        communicator, and NCCL (2.26+) destroys a communicator only once every graph that captured a collective on
        it is gone, so ``destroy_process_group`` waits forever while they live (pytorch#115388). Call it on every
        rank before ``destroy_process_group``; a later sequence-parallel call makes them again, on every rank at once.
        Data-parallel encoding captures no collective and needs no release."""
        graphs = self.sequence_graphs
        if graphs is not None:
            for runtime in graphs.compiled.vgraph.runtimes:
                runtime.release()
            self.__dict__["sequence_graphs"] = None

    def _sequence_slice(
        self, pixel_values: torch.Tensor, split: sequence_parallel.Split, graphs: _SequenceGraphs
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The sequence graphs' inputs on this rank: its slice of the rows, padded (a new tensor: the graphs pin a
        view's offset), and its grid metadata."""
        start, stop = split.rows(graphs.rank)
        padding = pixel_values.new_zeros(split.slice_rows - (stop - start), *pixel_values.shape[1:])
        rows = torch.cat([pixel_values[start:stop], padding])
        return rows, graphs.grid_metadata(split.grid, pixel_values.device)

    def _gather_sequence(
        self, local: list[torch.Tensor], split: sequence_parallel.Split, graphs: _SequenceGraphs
    ) -> list[torch.Tensor]:
        """The flat output fields of the whole batch from every rank's encoded slice."""
        unit, _ = rows_per_unit(self.interface.outputs)
        return sequence_parallel.gather(local, self._flat_folds(), unit, split, graphs.rank, graphs.group)
