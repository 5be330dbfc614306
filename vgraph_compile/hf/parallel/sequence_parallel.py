"""Sequence-parallel encoding over a ``torch.distributed`` process group: each rank encodes a slice of the rows.

Every rank holds the whole tower and is called with the same full batch (checked by ``rank_agreement``). Per
call, on every rank, with no communication but the attention's and the final gather:

1. **Split** (``split_rows``): a pure function of the grid. The packed rows are cut into ``ranks`` contiguous slices:
   rank ``r`` takes rows ``[r * slice_rows, (r + 1) * slice_rows)``, the last rank the rest (possibly none),
   padded with zero rows to ``slice_rows``, so the ranks' slices side by side are the packed order with the padding
   at the end. Every cut lies on a merge-unit boundary and, on a windowed tower, on a window-row boundary of its
   frame (a band of whole windows: the window permutation then maps each slice onto itself, and every window lies
   in one slice). ``slice_rows`` is the smallest such size at least ``rows / ranks``.
2. **Localize** (``localize``): the tower's grid metadata for the whole batch (the learned plan), made this rank's:
   row-aligned parts (position ids, interpolation indices: the plan's ``metadata_patches_per_row``) sliced and
   padded; a row-aligned 1-D integer part (a row permutation: Qwen2.5-VL's ``window_index``) sliced and shifted to
   local rows, the padding mapped onto itself; window offsets (``VGraphConfig.window_offsets``) cut to the slice,
   the padding one more window, every rank given as many entries (empty segments) so that all ranks choose the same
   bucket; every other offsets tensor (full attention) kept whole, with the padding as one more segment, so its
   last entry is ``ranks * slice_rows`` (``kernels/sequence.py`` reads the slice size from it); an int that is no
   row count (a ``max_seqlen``) capped at ``slice_rows``, which bounds every window (each lies in one slice) and
   keeps the bucket choice on the local rows (a full-attention site bounds its segments by ``ranks`` x its rows).
3. **Encode**: once every rank cut its slice (``rank_agreement.agree_on_success``), the tower's sequence graph
   (``rewrite/sequence_attention``: full attention over the group, one all-to-all pair per layer, inside the
   captured graphs) on the local rows, from the buckets every rank captured (``rank_agreement.common_budgets``,
   agreed before the graphs serve any call).
4. **Gather** (``gather``): once every rank's graph returned (agreed again), one ``all_gather_into_tensor`` of every
   rank's outputs (``data_parallel.gather``, one "item" per rank), the padding dropped.

Covered: towers whose only row-mixing operations are varlen attention and row permutations by a metadata index
within the slice (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). A metadata index that leaves its slice raises (``localize``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.hf.parallel import data_parallel
from vgraph_compile.hf.interface.packed_tower import metadata_leaves

__all__ = ["Split", "gather", "localize", "sequence_config", "split_rows"]

Rows = tuple[int, int, int]

DEFAULT_SEQUENCE_COST = 1.2
"""``parallel="auto"``: a sequence-parallel row costs this many data-parallel rows (its attention all-to-alls;
``hf/parallel/parallel_plan``)."""


@dataclass(frozen=True)
class Split:
    """Rank ``r`` encodes packed rows ``rows(r)`` of ``grid``; every rank runs ``slice_rows`` rows (the last padded)."""

    grid: tuple[Rows, ...]
    total: int
    ranks: int
    slice_rows: int

    def rows(self, rank: int) -> tuple[int, int]:
        return min(rank * self.slice_rows, self.total), min((rank + 1) * self.slice_rows, self.total)


def _frames(grid: tuple[Rows, ...]) -> Iterator[tuple[int, int, int]]:
    """(first row, rows, width in patches) of every frame, in packed order."""
    start = 0
    for t, h, w in grid:
        for _ in range(t):
            yield start, h * w, w
            start += h * w


def _cuts(grid: tuple[Rows, ...], geometry: VisionGeometry, unit: int) -> list[int]:
    """Every row a slice may start at, ascending: frame starts, then within a frame every ``unit`` rows, or every
    band of whole windows (window side x frame width) on a windowed tower; the total last."""
    cuts = []
    for start, rows, width in _frames(grid):
        step = geometry.window_size // geometry.patch_size * width if geometry.window_size else unit
        cuts.extend(range(start, start + rows, step))
    cuts.append(sum(t * h * w for t, h, w in grid))
    return cuts


@functools.lru_cache(maxsize=1024)
def split_rows(grid: tuple[Rows, ...], geometry: VisionGeometry, ranks: int, unit: int) -> Split:
    """The smallest ``slice_rows`` at least ``total / ranks`` whose every multiple below the total is a cut
    (``_cuts``); the total itself always is, so a grid too coarse to share leaves later ranks empty. ``unit``
    (patches per merged row) divides every cut."""
    cuts = _cuts(grid, geometry, unit)
    total, allowed = cuts[-1], set(cuts)
    lowest = -(-total // ranks)
    for size in cuts[bisect.bisect_left(cuts, lowest) :]:
        if size % unit == 0 and all(r * size >= total or r * size in allowed for r in range(1, ranks)):
            return Split(grid, total, ranks, size)
    raise AssertionError(f"no cut of {grid}: the total is a cut")  # unreachable: size == total qualifies


def _is_offsets(value: Any, total: int) -> bool:
    return (
        isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point() and len(value) > 1
        and int(value[0]) == 0 and int(value[-1]) == total
    )


def _local_windows(offsets: torch.Tensor, start: int, stop: int, slice_rows: int) -> list[int]:
    """The window offsets inside rows [start, stop), from 0; the padding rows one more window."""
    values = offsets.tolist()
    if start not in values or stop not in values:
        raise RuntimeError(f"rows [{start}, {stop}) cut a window of {values}: the split must cut at window edges")
    local = [value - start for value in values if start <= value <= stop]
    return local + [slice_rows] if stop - start < slice_rows else local


def _local_rows(value: torch.Tensor, per_row: int, split: Split, rank: int) -> torch.Tensor:
    """Rows of a row-aligned part for this rank's slice, padded: a 1-D integer part (a row index) shifted to local
    rows with its padding mapped onto itself; any other part padded with zeros (a valid position or table row). A
    row index that leaves any rank's slice raises, on every rank alike (each checks every slice, not its own)."""
    size = split.slice_rows // per_row
    if value.dim() == 1 and not value.is_floating_point():
        for other in range(split.ranks):
            first, last = (row // per_row for row in split.rows(other))
            rows = value[first:last]
            if len(rows) and (int(rows.min()) < first or int(rows.max()) >= last):
                raise RuntimeError(
                    f"a row index of the tower's metadata reads rows outside rank {other}'s slice [{first}, {last}): "
                    "the tower mixes rows beyond its attention, which sequence-parallel encoding does not cover"
                )
    start, stop = (row // per_row for row in split.rows(rank))
    mine = value[start:stop]
    if value.dim() == 1 and not value.is_floating_point():
        return torch.cat([mine - start, torch.arange(stop - start, size, dtype=value.dtype)])
    return torch.cat([mine, mine.new_zeros(size - (stop - start), *value.shape[1:])])


def localize(
    metadata: dict[str, Any],
    relations: dict[tuple[str, int], int],
    window_keys: tuple[str, ...],
    split: Split,
    rank: int,
) -> dict[str, Any]:
    """This rank's grid metadata from the whole batch's (module docstring, step 2); host tensors in, host out."""
    ranks, slice_rows, total = split.ranks, split.slice_rows, split.total
    local = {}
    for key, value in metadata.items():
        parts = []
        for part, leaf in enumerate(metadata_leaves(value)):
            per_row = relations.get((key, part))
            if per_row is not None:
                leaf = (
                    _local_rows(leaf, per_row, split, rank)
                    if isinstance(leaf, torch.Tensor)
                    else slice_rows // per_row
                )
            elif _is_offsets(leaf, total) and key in window_keys:
                every = [_local_windows(leaf, *split.rows(r), slice_rows) for r in range(ranks)]
                longest = max(map(len, every))
                mine = every[rank]
                leaf = torch.tensor(mine + mine[-1:] * (longest - len(mine)), dtype=leaf.dtype)
            elif _is_offsets(leaf, total) and ranks * slice_rows > total:
                leaf = torch.cat([leaf, leaf.new_tensor([ranks * slice_rows])])
            elif type(leaf) is int:
                leaf = min(leaf, slice_rows)
            parts.append(leaf)
        local[key] = type(value)(parts) if isinstance(value, (tuple, list)) else parts[0]
    return local


def gather(
    local: list[torch.Tensor], folds: list[int], unit: int, split: Split, rank: int, group
) -> list[torch.Tensor]:
    """Every rank's real output rows, in packed order, on every rank: ``data_parallel.gather`` with rank ``r``'s
    slice as item ``r``. ``local[f]`` has ``folds[f]`` rows per unit of ``unit`` patches."""
    units = [(stop - start) // unit for start, stop in map(split.rows, range(split.ranks))]
    assignment = data_parallel.Assignment(
        tuple((r,) for r in range(split.ranks)), tuple(size * unit for size in units)
    )
    real = [output[: units[rank] * fold] for output, fold in zip(local, folds)]
    return data_parallel.gather(real, folds, units, assignment, rank, group)


def sequence_config(config, group_name: str, ranks: int, window_inputs: tuple[str, ...]):
    """``config`` for the tower's sequence graph: full attention over the ``ranks`` of the group ``group_name``, the
    window groups (which stay local) named by their graph inputs ``window_inputs``. Each call takes the smallest
    bucket that holds it (``call_choice="smallest_bucket"``): its sizes are the same on every rank, so every rank
    takes the same bucket and runs the same collectives; a choice by each rank's own measured costs could differ
    between ranks (one padding, another splitting or running eagerly) and leave them out of step."""
    return dataclasses.replace(
        config, sequence_parallel=(group_name, ranks), window_offsets=window_inputs, call_choice="smallest_bucket"
    )

