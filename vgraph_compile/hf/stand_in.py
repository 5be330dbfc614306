"""``TowerStandIn``: what a compiled tower shares with the stock tower it stands in for, whatever its path.

Invariant: the stand-in holds the stock tower as ``self.tower`` and shares its parameter, buffer and module tables
(state_dict keys and parameter names are the tower's own), reads every attribute it lacks from the tower,
moves the tower's training flag with its own (the stock tower serves training calls), and after
``.to()``/``.float()``... drops what it compiled (``_reset``), since the tensors the graphs were built on changed.
A tier that refuses the tower hands it down (``hand_down``): the module the tier below makes then serves every
call, and its runtimes and stats are the stand-in's, until the tensors change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["TowerStandIn", "TraceRefused", "first_line"]


class TraceRefused(Exception):
    """A tier's trace of the tower was refused at a call (``args[0]``: the refusal, a ValueError): the tier hands the
    tower down, and the stand-in's ``forward`` serves the call by the module below."""


def first_line(error: Exception) -> str:
    """An error as a tier names it in the reason it gives: its type and the first line of its message."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class TowerStandIn(torch.nn.Module):
    """Base of every tier's compiled tower: ``CompiledVisionTower`` (packed), ``CompiledTileTower`` (fixed tiles),
    ``CompiledBlockTower``, ``CompiledExactSizeTower``. A tier gives its own ``_runtimes`` and ``_stats_table``."""

    def __init__(self, tower: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["tower"] = tower  # its tables, not the tower itself, are this module's: names stay the same
        self._parameters = tower._parameters
        self._buffers = tower._buffers
        self._non_persistent_buffers_set = tower._non_persistent_buffers_set
        self._modules = tower._modules
        self.training = tower.training
        self.__dict__["replacement"] = None
        """The module the tier below made when this tier refused the tower (``hand_down``); None: this tier serves.
        Kept outside the module tables, which are the tower's."""

    def _reset(self) -> None:
        """Drop what was compiled for the tower's old tensors: the next call traces and captures again."""
        raise NotImplementedError

    def hand_down(self, tier_below: Callable[[str], torch.nn.Module], reason: str) -> torch.nn.Module:
        """``tier_below(reason)``, the module that serves this call and every later one from now on."""
        self.__dict__["replacement"] = tier_below(reason)
        return self.replacement

    @property
    def runtimes(self) -> list:
        """The vgraph runtimes behind this tower; once it was handed down, those of the module serving it."""
        return self.replacement.runtimes if self.replacement is not None else self._runtimes()

    def capture_all(self) -> None:
        """Return once every graph of this tower's runtimes is captured (by default they are captured behind the
        first calls: ``VGraphConfig.captures``), capturing what is left now."""
        for runtime in self.runtimes:
            runtime.warmup()

    def stats_table(self) -> str:
        """The tier and its runtimes' buckets; once the tower was handed down, the serving module's."""
        return self.replacement.stats_table() if self.replacement is not None else self._stats_table()

    def _runtimes(self) -> list:
        raise NotImplementedError

    def _stats_table(self) -> str:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            tower = self.__dict__.get("tower")
            if tower is None:
                raise
            return getattr(tower, name)

    def train(self, mode: bool = True) -> "TowerStandIn":
        super().train(mode)
        self.tower.training = mode
        return self

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.float()``, ``.cuda()``...: the tensors change, so the next call traces and captures again."""
        result = super()._apply(fn, *args, **kwargs)
        self.__dict__["replacement"] = None
        self._reset()
        return result
