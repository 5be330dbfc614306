"""The grid metadata cache: a tower's ``grid_thw``-derived keywords, computed on the host once per distinct grid.

Which keywords a tower pops, and how each is computed from the grid, is the tower's learned plan
(``PackedTower.metadata``, from ``metadata_plan``); this module only computes and keeps them. The routed attention
is on while computing, so ``get_max_seqlen`` computes ``max_seqlen`` as it does in the trace.

Invariant: a cached entry is exactly what ``PackedTower.metadata.compute`` returns for that grid (and, for a tower
that reads its grid outside its metadata functions, the grid itself as a table of ``grid_rows`` rows under the
grid argument's name: ``PackedTower.grid_table``; passed through ``localize`` when one is given: a
sequence-parallel rank's share, ``hf/parallel/sequence_parallel``), moved to the device it was asked for, as plain tensors
(outside inference mode: they keep a version counter, so the runtime skips re-copying them); at most ``size``
entries are kept (the least recently used one goes first).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import torch

from vgraph_compile.hf.attention import routed_attention
from vgraph_compile.hf.interface.packed_tower import PackedTower

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
        grid_rows: int | None = None,
        localize: Callable[[Grid, dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        """``grid_rows``: the row count of a ``grid_traced`` tower's grid table (more than any call's segments);
        None: each grid's own row count (one traced shape per grid, as an exact-shape compile has)."""
        self.tower, self.interface, self.size, self.grid_rows = tower, interface, size, grid_rows
        self.localize = localize
        self._entries: collections.OrderedDict[tuple[Grid, torch.device], dict] = collections.OrderedDict()
        self._lock = threading.Lock()
        """Held around each read and write of ``_entries`` (threads share it; another's eviction must not land
        between a lookup and its read)."""

    def __call__(self, grid: Grid, device: torch.device | str) -> dict:
        key = (grid, torch.device(device))
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                return cached
        with torch.inference_mode(False), routed_attention(self.tower):
            grid_thw = torch.tensor(grid, dtype=torch.int64)
            host = self.interface.metadata.compute(grid_thw)
            if self.interface.grid_traced:
                rows = len(grid) if self.grid_rows is None else self.grid_rows
                host[self.interface.grid_argument] = self.interface.grid_table(grid_thw, rows)
            if self.localize is not None:
                host = self.localize(grid, host)
            metadata = {
                name: value.to(key[1]) if isinstance(value, torch.Tensor) else value for name, value in host.items()
            }
        with self._lock:
            self._entries[key] = metadata
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return metadata

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
