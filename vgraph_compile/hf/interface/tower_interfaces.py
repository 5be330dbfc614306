"""Saved tower interfaces: a later process reads a packed tower's learned interface instead of probing the tower.

``tower_interface(tower, directory)`` returns the ``PackedTower`` saved in the artifact directory under the tower's
``interface_key``, or learns it (``learn_packed_tower``: eager forwards of a shrunk tower) and saves it there; a
refusal (``TowerRefused``) is saved and raised again the same way, unless the machine caused it (out of memory, a
missing package: ``refused_by_environment``). A
warm start thus runs no probe forward (``counters.probe_forwards`` does not move; ``interfaces_loaded`` does).

Key: what the interface depends on, and nothing else (never the weights, the device or the dtype: the probe runs
a shrunk tower of the same class and config on the host): the class of every module in the tower and the source
file each is defined in, the config (all of it, as ``to_dict`` gives it), and the transformers, torch and vgraph
versions (vgraph's: the hash of its sources). The entry holds no config: a loaded interface reads the tower's
own (``PackedTower.bound``). A file saved under the key that is of another kind, or corrupt
(its bytes do not match its record, or it cannot be unpickled), is logged, removed and learned again, as build
plans are (``compile/artifacts``). A tower of another config has another key, so its interface is learned again.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from pathlib import Path

import torch

from vgraph_compile.compile import artifacts
from vgraph_compile.counters import counters
from vgraph_compile.hf.interface.metadata_plan import TowerRefused
from vgraph_compile.hf.interface.packed_tower import PackedTower, learn_packed_tower, refused_by_environment

__all__ = ["interface_key", "tower_interface"]

log = logging.getLogger(__name__)


@functools.cache
def _class_source(kind: type) -> str:
    """The hash of the file ``kind`` is defined in (its forward and whatever it calls there)."""
    try:
        return hashlib.sha256(Path(inspect.getsourcefile(kind)).read_bytes()).hexdigest()
    except (TypeError, OSError):
        return kind.__qualname__


def interface_key(tower: torch.nn.Module) -> str:
    """The key of ``tower``'s interface (the module docstring's list)."""
    import transformers

    kinds = sorted({type(module) for module in tower.modules()}, key=lambda kind: (kind.__module__, kind.__qualname__))
    config = tower.config
    parts = {
        "classes": [[f"{kind.__module__}.{kind.__qualname__}", _class_source(kind)] for kind in kinds],
        "config": f"{type(config).__module__}.{type(config).__qualname__}",
        "fields": config.to_dict() if hasattr(config, "to_dict") else repr(config),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "vgraph": artifacts.sources_hash(),
    }
    return "interface-" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tower_interface(tower: torch.nn.Module, directory: Path | None) -> PackedTower:
    """``tower``'s interface: loaded from ``directory`` when saved there under its key, else learned and saved
    (None: learned, never saved)."""
    if directory is None:
        return learn_packed_tower(tower)
    key = interface_key(tower)
    saved = artifacts.load_plan(directory, key)
    if saved is not None and not isinstance(saved, (PackedTower, TowerRefused)):
        artifacts.discard_plan(directory, key, f"holds a {type(saved).__name__}, not a PackedTower")
        saved = None
    if saved is not None:
        counters.interfaces_loaded += 1
        log.info("vgraph: %s: interface loaded from %s (no probe)", type(tower).__name__, directory)
        if isinstance(saved, TowerRefused):
            raise TowerRefused(*saved.args)
        return saved.bound(tower)
    try:
        interface = learn_packed_tower(tower)
    except TowerRefused as refusal:  # the same code and config refuse again: a later start need not probe
        if not refused_by_environment(refusal):  # out of memory, a missing package: another start may pass
            artifacts.save_plan(directory, key, TowerRefused(*refusal.args))
        raise
    artifacts.save_plan(directory, key, interface.bound(None))
    return interface
