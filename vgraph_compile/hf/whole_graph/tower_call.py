"""``TowerCall``: the forward the whole-tower graph traces (the tower with its grid withheld and every grid-derived
value passed in), the names its trace gives the window offsets, and ``own_code`` (a function copy with a trace cache of
its own, for every forward a tier hands dynamo)."""

from __future__ import annotations

import functools
import types

import torch

from vgraph_compile.config import VGraphConfig
from vgraph_compile.hf.interface.packed_tower import PackedTower, metadata_leaves

__all__ = ["TowerCall", "own_code", "traced_window_offsets"]


def own_code(function):
    """A copy of ``function`` with a code object of its own: dynamo keeps traces, and counts its recompile limit, per
    code object, so each copy has its own trace cache (two towers compiled in one process never share one)."""
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)  # fmt: skip
    return functools.update_wrapper(own, function)


class TowerCall(torch.nn.Module):
    """The traced forward: the tower with its grid withheld (or, for a ``grid_traced`` tower, passed in as a
    fixed-size table among the metadata) and every grid-derived value passed in, so nothing syncs the host; takes
    and returns rows packed along dim 0 (a ``batched`` tower gets its leading dim of 1 added, and its batched
    fields lose it); returns the output fields flat (list fields expanded).

    The ``torch._check`` calls state what holds by construction (one position id per patch, one window-index entry
    per merged token: the learned ``metadata_patches_per_row``), so the trace gives those lengths one symbol.

    Each instance's ``forward`` has its own code object: dynamo keeps traces, and counts its recompile limit, per
    code object, so towers compiled in one process never share (and exhaust) one forward's trace cache.
    """

    def __init__(self, tower: torch.nn.Module, interface: PackedTower) -> None:
        super().__init__()
        self.tower = tower
        self.grid_argument = interface.grid_argument
        self.batched = interface.batched
        self.relations = interface.metadata_patches_per_row
        self.outputs = interface.outputs
        self.forward = types.MethodType(own_code(type(self).forward), self)

    def forward(self, pixel_values, **metadata):
        patches = pixel_values.shape[0]
        for (key, part), per_row in self.relations.items():
            value = metadata_leaves(metadata[key])[part]
            torch._check((value.shape[0] if isinstance(value, torch.Tensor) else value) * per_row == patches)
        rows = pixel_values[None] if self.batched else pixel_values
        out = self.tower(rows, **{self.grid_argument: None, **metadata})
        flat = []
        for field in self.outputs:
            value = out[field.name]
            values = value if isinstance(value, (list, tuple)) else (value,)
            flat.extend(tensor[0] if field.batched else tensor for tensor in values)
        return tuple(flat)


def traced_window_offsets(config: VGraphConfig) -> tuple[str, ...]:
    """``config.window_offsets`` (the tower's metadata keys, e.g. ``cu_window_seqlens``) as the trace of
    ``TowerCall`` names those inputs (``metadata_<key>``, from its ``**metadata``): the names the analysis matches
    to find the window group, which then gets the window bound instead of the token budget."""
    return tuple(f"metadata_{key}" for key in config.window_offsets)
