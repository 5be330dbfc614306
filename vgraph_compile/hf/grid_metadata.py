"""The grid metadata cache: a tower's ``grid_thw``-derived keywords, computed on the host once per distinct grid.

Which keywords a tower pops, and how each is computed from the grid, is the tower's learned plan
(``PackedTower.metadata``, from ``metadata_plan``); this module only computes and keeps them. The routed attention
is on while computing, so ``get_max_seqlen`` computes ``max_seqlen`` as it does in the trace.

Invariant: a cached entry is exactly what ``PackedTower.metadata.compute`` returns for that grid (passed through
``localize`` when one is given: a sequence-parallel rank's share, ``hf/sequence_parallel``), moved to the
device it was asked for, as plain tensors (outside inference mode: they keep a version counter, so the runtime
skips re-copying them); at most ``size`` entries are kept (the least recently used one goes first).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.packed_tower import PackedTower

__all__ = ["Grid", "GridMetadata", "grid_of"]

Grid = tuple[tuple[int, int, int], ...]
"""``grid_thw`` as a hashable tuple of (t, h, w) rows, in patches."""


def grid_of(grid_thw: torch.Tensor) -> Grid:
    """``grid_thw`` as a hashable tuple of (t, h, w) rows (reads the tensor on the host)."""
    return tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())


class GridMetadata:
    """``(grid, device) -> the tower's grid metadata keywords on that device``, cached."""

    def __init__(
        self,
        tower: torch.nn.Module,
        interface: PackedTower,
        size: int = 1024,
        localize: Callable[[Grid, dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.tower, self.interface, self.size, self.localize = tower, interface, size, localize
        self._entries: collections.OrderedDict[tuple[Grid, torch.device], dict] = collections.OrderedDict()

    def __call__(self, grid: Grid, device: torch.device | str) -> dict:
        key = (grid, torch.device(device))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        with torch.inference_mode(False), routed_attention(self.tower):
            host = self.interface.metadata.compute(torch.tensor(grid, dtype=torch.int64))
            if self.localize is not None:
                host = self.localize(grid, host)
            metadata = {
                name: value.to(key[1]) if isinstance(value, torch.Tensor) else value for name, value in host.items()
            }
        self._entries[key] = metadata
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return metadata

    def clear(self) -> None:
        self._entries.clear()
