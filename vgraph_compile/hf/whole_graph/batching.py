"""Greedy packing of a call's items into batches that fit the largest bucket (as vLLM's encoder manager does).

Items are visited smallest first; an item joins the open batch while the batch stays within the token budget,
``max_items`` items and ``max_frames`` frames, else the batch is closed. An item that alone exceeds a limit gets a
batch of its own, marked ``eager`` (it runs the traced graph eagerly). Batches keep the caller's item indices,
so outputs can be put back in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Batch", "pack", "row_starts"]


@dataclass(frozen=True)
class Batch:
    items: tuple[int, ...]
    """Indices into the caller's grid, in the order they are packed."""
    eager: bool = False


def pack(grid: list[tuple[int, int, int]], budget: int, max_items: int, max_frames: int) -> list[Batch]:
    """Batches covering every item exactly once."""
    order = sorted(range(len(grid)), key=lambda index: grid[index][0] * grid[index][1] * grid[index][2])
    batches: list[Batch] = []
    items: list[int] = []
    tokens = frames = 0
    for index in order:
        t, h, w = grid[index]
        size = t * h * w
        if size > budget or t > max_frames:
            batches.append(Batch((index,), eager=True))
            continue
        if items and (tokens + size > budget or len(items) + 1 > max_items or frames + t > max_frames):
            batches.append(Batch(tuple(items)))
            items, tokens, frames = [], 0, 0
        items.append(index)
        tokens += size
        frames += t
    if items:
        batches.append(Batch(tuple(items)))
    return batches


def row_starts(grid) -> list[int]:
    """Where each item's rows start in pixel_values (and last_hidden_state), and the total at the end."""
    starts = [0]
    for t, h, w in grid:
        starts.append(starts[-1] + t * h * w)
    return starts
