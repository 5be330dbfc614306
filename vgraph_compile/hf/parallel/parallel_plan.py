"""Which items of a call go sequence parallel and which data parallel (``parallel="auto"``): a pure function of the
grid, so every rank of the group computes the same plan with no communication, and every rank issues the same
collectives.

The cost of a plan, in patch rows of the most loaded rank: its sequence part's slice (``Split.slice_rows``, every
rank the same) at ``sequence_cost`` per row (the attention all-to-alls), plus the most loaded rank's data-parallel
share (``data_parallel.assign``: whole items, largest first onto the least loaded rank). An item larger than a
rank's fair share keeps one rank busy while the others idle; splitting it by rows shares it. ``plan`` takes the
cheapest of the plans that move the ``k`` largest items (ties: lower index first) to the sequence part, for every
``k`` from 0 to all (ties: the smaller ``k``), so no item data parallel is larger than one split by rows. With
only small items nothing moves (all data parallel), with one dominant item only that one does; the pure modes are
``k = 0`` and ``k = all``, so the plan never costs more than either.

Before planning, a tower whose frames are independent (``CompiledVisionTower.frames_split_exactly``) may have its
large videos cut into items of whole frames (``split_frames``): those spread over the ranks by items, with no
collective inside the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vgraph_compile.hf.parallel import data_parallel

__all__ = ["ParallelPlan", "plan", "plan_cost", "split_frames"]

Rows = tuple[int, int, int]


@dataclass(frozen=True)
class ParallelPlan:
    """``sequence``: the items encoded sequence parallel (ascending); ``data``: the rest (ascending) and
    ``assignment``, which of them (indices into ``data``) each rank encodes; ``cost``: ``plan_cost``."""

    sequence: tuple[int, ...]
    data: tuple[int, ...]
    assignment: data_parallel.Assignment
    cost: float

    @property
    def mode(self) -> str:
        """``"data"``, ``"sequence"`` or ``"sequence+data"``: how the call is counted."""
        if not self.sequence:
            return "data"
        return "sequence" if not self.data else "sequence+data"


def plan_cost(
    grid: list[Rows] | tuple[Rows, ...],
    sequence: tuple[int, ...],
    ranks: int,
    slice_rows: Callable[[tuple[Rows, ...]], int],
    sequence_cost: float,
) -> tuple[float, tuple[int, ...], data_parallel.Assignment]:
    """(cost, data items, their assignment) of encoding ``sequence`` sequence parallel and the rest data parallel;
    ``slice_rows(sub_grid)`` is a rank's slice of a sub-grid split over the ranks."""
    chosen = set(sequence)
    data = tuple(index for index in range(len(grid)) if index not in chosen)
    assignment = data_parallel.assign([grid[index] for index in data], ranks)
    rows = slice_rows(tuple(grid[index] for index in sequence)) if sequence else 0
    return rows * sequence_cost + max(assignment.loads), data, assignment


def plan(
    grid: list[Rows] | tuple[Rows, ...],
    ranks: int,
    slice_rows: Callable[[tuple[Rows, ...]], int],
    sequence_cost: float,
) -> ParallelPlan:
    """The plan of the module docstring; with ``slice_rows`` a pure function, so is this."""
    sizes = [t * h * w for t, h, w in grid]
    order = sorted(range(len(grid)), key=lambda index: (-sizes[index], index))
    best = None
    for moved in range(len(grid) + 1 if ranks > 1 else 1):
        sequence = tuple(sorted(order[:moved]))
        cost, data, assignment = plan_cost(grid, sequence, ranks, slice_rows, sequence_cost)
        if best is None or cost < best.cost:
            best = ParallelPlan(sequence, data, assignment, cost)
    return best


def split_frames(grid: list[Rows] | tuple[Rows, ...], ranks: int) -> tuple[Rows, ...]:
    """``grid`` with each video larger than a rank's fair share (its patches over ``total / ranks``) as
    ``min(t, ranks)`` items of consecutive frames, as even as can be (the first ones a frame longer); the other
    items as they are. The rows, in order, are the same rows: the items' rows concatenated are the video's."""
    total = sum(t * h * w for t, h, w in grid)
    out: list[Rows] = []
    for t, h, w in grid:
        parts = min(t, ranks)
        if parts > 1 and t * h * w * ranks > total:
            out.extend((t // parts + (part < t % parts), h, w) for part in range(parts))
        else:
            out.append((t, h, w))
    return tuple(out)
