"""Saved compiled graphs: a second process loads the inductor compile of an encoder instead of compiling it.

An artifact is ``torch._inductor.standalone_compile``'s ``CompiledArtifact`` (the compiled code and what loading it
needs), saved as ``<key>.bin`` in the artifact directory, with ``<key>.json`` beside it: the key, the SHA-256 of the
``.bin`` and the budgets the compiled code serves (``compile/inductor``'s guard checks, made at the compile).

Invariant: an artifact is used only for a compile that would produce it. The key hashes everything that changes
the compiled code: the rewritten graph's code, each input's dtype, shape (in the trace's symbols), strides and
device, the symbols' ranges, every tensor constant's bytes, the config (all but ``artifact_dir``), the attention
kernels chosen, the inductor config, the torch version, the vgraph sources and the device (its name and compute
capability on CUDA). Never the weights: parameters are graph inputs, read at every call. A file whose bytes do not
match its ``.json``, or that torch cannot load, is logged, removed and compiled again; never used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx

from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import PassContext

__all__ = ["Artifact", "artifact_dir", "artifact_key", "available", "load", "save"]

log = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "VGRAPH_ARTIFACT_DIR"


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: the compiled code and the budgets it serves."""

    compiled: Callable[..., Any]
    served: tuple[int, ...]


def available() -> bool:
    """Whether this torch can save and load compiled artifacts (``torch._inductor.standalone_compile``)."""
    return hasattr(torch._inductor, "standalone_compile") and hasattr(torch._inductor, "CompiledArtifact")


def artifact_dir(ctx: PassContext) -> Path | None:
    """Where this encoder's artifacts live; None when saving and loading are off."""
    configured = ctx.config.artifact_dir
    if configured is None:
        configured = os.environ.get(ENVIRONMENT_VARIABLE)
    if configured is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        configured = os.path.join(cache_dir(), "vgraph_artifacts")
    return Path(configured) if configured else None


@functools.cache
def _sources_hash() -> str:
    """The vgraph sources: a change to any pass or kernel may change the compiled code."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _device(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(index)} sm{''.join(map(str, torch.cuda.get_device_capability(index)))}"


def _describe_input(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(map(str, value.shape))} {tuple(map(str, value.stride()))} {value.device.type}"
    return f"{type(value).__name__} {value}"


def _constants(gm: torch.fx.GraphModule) -> list[str]:
    """The bytes of every tensor the graph reads as a constant (they are compiled in, unlike parameters)."""
    hashes = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            hashes.append(f"{node.target} {_describe_input(value)} {hashlib.sha256(data).hexdigest()}")
    return hashes


def artifact_key(gm: torch.fx.GraphModule, ctx: PassContext) -> str:
    """A hash of everything that changes the code inductor compiles from ``gm`` (the module docstring's list)."""
    shape_env = ctx.shape_env
    parts = {
        "graph": gm.code,
        "inputs": [_describe_input(example_value(node)) for node in gm.graph.find_nodes(op="placeholder")],
        "ranges": sorted(f"{symbol}: {bounds}" for symbol, bounds in shape_env.var_to_range.items()),
        "replacements": sorted(f"{symbol} = {value}" for symbol, value in shape_env.replacements.items()),
        "constants": _constants(gm),
        "config": repr(dataclasses.replace(ctx.config, artifact_dir=None)),
        "kernels": sorted(ctx.kernels.items()),
        "inductor": sorted(
            f"{name}={value!r}"
            for name, value in torch._inductor.config.get_config_copy().items()
            if " at 0x" not in repr(value)  # a callable's address changes per process
        ),
        "torch": torch.__version__,
        "vgraph": _sources_hash(),
        "device": _device(ctx.device),
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _discard(paths: list[Path], why: str) -> None:
    log.warning("vgraph: compiled artifact %s %s; compiling again", paths[0], why)
    for path in paths:
        path.unlink(missing_ok=True)


def load(directory: Path, key: str) -> Artifact | None:
    """The artifact saved under ``key``, or None (absent, or stale or corrupt: then logged and removed)."""
    binary, record = directory / f"{key}.bin", directory / f"{key}.json"
    if not binary.exists() and not record.exists():
        return None
    try:
        meta = json.loads(record.read_text())
        if meta["key"] != key:
            _discard([binary, record], f"was saved for another compile (key {meta['key']})")
            return None
        if _file_hash(binary) != meta["sha256"]:
            _discard([binary, record], "does not match the hash saved with it (truncated or overwritten)")
            return None
        compiled = torch._inductor.CompiledArtifact.load(path=str(binary), format="binary")
        served = tuple(int(budget) for budget in meta["served"])
    except Exception as error:  # any unreadable file is rebuilt, whatever torch raised reading it
        _discard([binary, record], f"could not be loaded ({type(error).__name__}: {error})")
        return None
    log.info("vgraph: loaded the compiled encoder from %s", binary)
    return Artifact(compiled, served)


def save(directory: Path, key: str, artifact: Any, served: tuple[int, ...]) -> bool:
    """Save ``artifact`` (a ``CompiledArtifact``) under ``key``; False (logged) when it cannot be saved."""
    binary, record = directory / f"{key}.bin", directory / f"{key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        artifact.save(path=str(binary), format="binary")
        meta = {"key": key, "sha256": _file_hash(binary), "served": list(served), "torch": torch.__version__}
        temporary = record.with_suffix(f".json.{os.getpid()}")
        temporary.write_text(json.dumps(meta))
        temporary.replace(record)
    except Exception as error:  # saving is an optimization: the compiled code in hand still serves
        log.warning("vgraph: could not save the compiled encoder to %s (%s: %s)", binary, type(error).__name__, error)
        return False
    log.info("vgraph: saved the compiled encoder to %s", binary)
    return True
