"""The grid metadata cache: a tower's ``grid_thw``-derived keywords, computed on the host once per distinct grid.

Invariant: a cached entry is exactly what ``TowerKind.metadata`` returns for that grid, moved to the device it
was asked for; at most ``size`` entries are kept (the least recently used one goes first).
"""

from __future__ import annotations

import collections

import torch

from vgraph_compile.hf.tower_kinds import Grid, TowerKind

__all__ = ["GridMetadata", "grid_of"]


def grid_of(grid_thw: torch.Tensor) -> Grid:
    """``grid_thw`` as a hashable tuple of (t, h, w) rows (reads the tensor on the host)."""
    return tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())


class GridMetadata:
    """``(grid, device) -> the tower's grid metadata keywords on that device``, cached."""

    def __init__(self, tower: torch.nn.Module, kind: TowerKind, size: int = 1024) -> None:
        self.tower, self.kind, self.size = tower, kind, size
        self._entries: collections.OrderedDict[tuple[Grid, torch.device], dict] = collections.OrderedDict()

    def __call__(self, grid: Grid, device: torch.device | str) -> dict:
        key = (grid, torch.device(device))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        with torch.inference_mode(False):  # plain tensors, usable outside inference mode too
            host = self.kind.metadata(self.tower, torch.tensor(grid, dtype=torch.int64))
            metadata = {
                name: value.to(key[1]) if isinstance(value, torch.Tensor) else value for name, value in host.items()
            }
        self._entries[key] = metadata
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return metadata

    def clear(self) -> None:
        self._entries.clear()
