"""Saved builds: a second process loads an encoder's inductor compile, and its build plan, instead of making them.

An artifact is ``torch._inductor.standalone_compile``'s ``CompiledArtifact`` (the compiled code and what loading it
needs), saved as ``<key>.bin`` in the artifact directory, with ``<key>.bin.json`` beside it: the key, the SHA-256
of the ``.bin`` and the budgets the compiled code serves (``compile/inductor``'s guard checks, made at the
compile). A build plan (``entry/warm_start``: what serving needs besides the compiled code) is pickled as
``<key>.plan`` with its ``<key>.plan.json`` record, under the plan's own key.

Invariant: an artifact is used only for a compile that would produce it. The key hashes everything that changes
the compiled code: the rewritten graph's code, each input's dtype, shape (in the trace's symbols), strides and
device, the symbols' ranges, every tensor constant's bytes, the config (all but ``artifact_dir``), the attention
kernels chosen, the inductor config, the torch version, the code of the vgraph modules that shape it
(``SHAPING_SOURCES``) and the device (its name and compute
capability on CUDA). Never the weights: parameters are graph inputs, read at every call. A file whose bytes do not
match its record, that was saved under another key, or that cannot be loaded, is logged, removed and built
again; never used. The files are trusted as inductor's own cache is (a plan is a pickle): keep the directory
writable by its owner only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import sympy
import torch
import torch.fx
import torch.utils._sympy.functions as sympy_functions

from vgraph_compile import json_cache
from vgraph_compile.fx_utils import example_value
from vgraph_compile.spec import PassContext

if TYPE_CHECKING:
    from vgraph_compile.config import VGraphConfig

__all__ = [
    "Artifact", "artifact_dir", "artifact_key", "available", "configured_dir", "describe_input", "device_name",
    "discard_plan", "load", "load_plan", "save", "save_plan", "settings", "sources_hash", "SHAPING_SOURCES",
]

log = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "VGRAPH_ARTIFACT_DIR"


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: the compiled code, the budgets it serves, and what its compile found about sizes."""

    compiled: Callable[..., Any]
    served: tuple[int, ...]
    guards: tuple[sympy.Expr, ...] | None = None
    """Every size guard of the trace and the compile, in plain symbols named as the trace names its sizes (None:
    saved without them)."""
    dropped: tuple[tuple[int, str], ...] = ()
    """The budgets the compile dropped, each with its reason."""


def available() -> bool:
    """Whether this torch can save and load compiled artifacts (``torch._inductor.standalone_compile``)."""
    return hasattr(torch._inductor, "standalone_compile") and hasattr(torch._inductor, "CompiledArtifact")


def artifact_dir(config: "VGraphConfig") -> Path | None:
    """Where an encoder's artifacts live; None when saving and loading are off."""
    return configured_dir(config.artifact_dir)


def configured_dir(configured: str | os.PathLike | None) -> Path | None:
    """The artifact directory for an ``artifact_dir`` option: the option; else ``$VGRAPH_ARTIFACT_DIR``; else
    ``vgraph_artifacts`` in inductor's cache directory. None (an empty string) when saving and loading are off."""
    if configured is None:
        configured = os.environ.get(ENVIRONMENT_VARIABLE)
    if configured is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        configured = os.path.join(cache_dir(), "vgraph_artifacts")
    return Path(configured) if configured else None


SHAPING_SOURCES = ("*.py", "entry/*.py", "analyze/*.py", "rewrite/*.py", "compile/*.py", "kernels/*.py", "serve/*.py")
"""The package's modules that shape a trace, its plan or its compiled code (globs under the package): the records,
the pipeline, the entry points, the passes, the compile, the kernels and the per-call records a plan holds. Not:
``bench/``, ``sample_models/``, ``hf/`` (its classes' sources are keyed by the plan's module tree) and ``cli.py``."""

_PACKAGE = Path(__file__).resolve().parent.parent


def _code(source: bytes) -> bytes:
    """A module's code without its docstrings and comments: its AST, dumped."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


@functools.cache
def sources_hash(package: Path = _PACKAGE) -> str:
    """The code of ``SHAPING_SOURCES``: a change to a pass, a kernel or a record may change what is saved; a
    docstring, a comment or a benchmark module does not. Worked out from the modules' syntax trees once per set of
    file contents and kept (``vgraph_sources.json``, keyed by the files' bytes): parsing them took 0.7 s of every
    warm start on a 2-core host."""
    paths = sorted({path for pattern in SHAPING_SOURCES for path in package.glob(pattern)})
    contents = [(str(path.relative_to(package)).encode(), path.read_bytes()) for path in paths]
    key = hashlib.sha256(b"".join(name + b"\0" + data + b"\0" for name, data in contents)).hexdigest()
    saved = json_cache.cache_path("vgraph_sources.json")
    known = json_cache.load(saved).get(key)
    if isinstance(known, str):
        return known
    digest = hashlib.sha256()
    for name, data in contents:
        digest.update(name)
        digest.update(_code(data))
    json_cache.merge(saved, {key: digest.hexdigest()})
    return digest.hexdigest()


def device_name(device: torch.device) -> str:
    """The device as far as compiled code depends on it: its type, and on CUDA its name and compute capability."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(index)} sm{''.join(map(str, torch.cuda.get_device_capability(index)))}"


def settings(config: Any) -> list[str]:
    """A torch config module's settings as sorted text: sets sorted (their order changes per process), callables
    left out (their addresses do too)."""
    lines = []
    for name, value in config.get_config_copy().items():
        if isinstance(value, (set, frozenset)):
            value = sorted(value, key=repr)
        if not name.startswith("_") and " at 0x" not in repr(value):
            lines.append(f"{name}={value!r}")
    return sorted(lines)


def describe_input(value: Any) -> str:
    """A graph input as compiled code depends on it: a tensor's dtype, shape, strides and device; else its value."""
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
            hashes.append(f"{node.target} {describe_input(value)} {hashlib.sha256(data).hexdigest()}")
    return hashes


def artifact_key(gm: torch.fx.GraphModule, ctx: PassContext) -> str:
    """A hash of everything that changes the code inductor compiles from ``gm`` (the module docstring's list)."""
    shape_env = ctx.shape_env
    parts = {
        "graph": gm.code,
        "inputs": [describe_input(example_value(node)) for node in gm.graph.find_nodes(op="placeholder")],
        "ranges": sorted(f"{symbol}: {bounds}" for symbol, bounds in shape_env.var_to_range.items()),
        "replacements": sorted(f"{symbol} = {value}" for symbol, value in shape_env.replacements.items()),
        "constants": _constants(gm),
        "config": repr(dataclasses.replace(ctx.config, artifact_dir=None)),
        "kernels": sorted(ctx.kernels.items()),
        "inductor": settings(torch._inductor.config),
        "torch": torch.__version__,
        "vgraph": sources_hash(),
        "device": device_name(ctx.device),
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _discard(paths: list[Path], what: str, why: str) -> None:
    log.warning("vgraph: %s %s %s; building it again", what, paths[0], why)
    for path in paths:
        path.unlink(missing_ok=True)


def _read(binary: Path, what: str, key: str, parse: Callable[[Path, dict], Any]) -> Any:
    """``parse(binary, record)`` of the file saved under ``key`` with its ``.json`` record, or None: absent, or
    saved for another key, not matching its hash, or unreadable (then logged and removed, never used)."""
    record = binary.with_name(binary.name + ".json")
    if not binary.exists() and not record.exists():
        return None
    try:
        meta = json.loads(record.read_text())
        if meta["key"] != key:
            _discard([binary, record], what, f"was saved for another build (key {meta['key']})")
            return None
        if _file_hash(binary) != meta["sha256"]:
            _discard([binary, record], what, "does not match the hash saved with it (truncated or overwritten)")
            return None
        return parse(binary, meta)
    except Exception as error:  # any unreadable file is rebuilt, whatever raised reading it
        _discard([binary, record], what, f"could not be loaded ({type(error).__name__}: {error})")
        return None


def _write(binary: Path, what: str, key: str, write: Callable[[Path], None], **extra: Any) -> bool:
    """``write(binary)``, then its ``.json`` record (key, hash, ``extra``) atomically; False (logged) on failure."""
    record = binary.with_name(binary.name + ".json")
    try:
        binary.parent.mkdir(parents=True, exist_ok=True)
        write(binary)
        meta = {"key": key, "sha256": _file_hash(binary), "torch": torch.__version__, **extra}
        temporary = record.with_name(f"{record.name}.{os.getpid()}")
        temporary.write_text(json.dumps(meta))
        temporary.replace(record)
    except Exception as error:  # saving is an optimization: what is in hand still serves
        log.warning("vgraph: could not save the %s to %s (%s: %s)", what, binary, type(error).__name__, error)
        return False
    log.info("vgraph: saved the %s to %s", what, binary)
    return True


_SIZE_FUNCTIONS = {name: getattr(sympy_functions, name) for name in sympy_functions.__all__}
"""torch's sympy functions by name, as size guards print them (``PythonMod``...)."""


def _parsed_guard(text: str) -> sympy.Basic:
    """A saved size guard as an expression: torch's size functions by name, and ``True``/``False`` (a guard the
    ShapeEnv's replacements decided) as sympy's booleans (``sympify`` parses them to Python's, which have none of
    an expression's methods)."""
    return sympy.sympify(sympy.sympify(text, locals=_SIZE_FUNCTIONS))


def load(directory: Path, key: str) -> Artifact | None:
    """The artifact saved under ``key``, or None (absent, or stale or corrupt: then logged and removed)."""

    def parse(binary: Path, meta: dict) -> Artifact:
        compiled = torch._inductor.CompiledArtifact.load(path=str(binary), format="binary")
        texts = meta.get("guards")
        guards = None if texts is None else tuple(_parsed_guard(text) for text in texts)
        dropped = tuple((int(budget), str(reason)) for budget, reason in meta.get("dropped", ()))
        return Artifact(compiled, tuple(int(budget) for budget in meta["served"]), guards, dropped)

    artifact = _read(directory / f"{key}.bin", "compiled artifact", key, parse)
    if artifact is not None:
        log.info("vgraph: loaded the compiled encoder from %s", directory / f"{key}.bin")
    return artifact


def save(
    directory: Path,
    key: str,
    artifact: Any,
    served: tuple[int, ...],
    guards: tuple[str, ...],
    dropped: tuple[tuple[int, str], ...] = (),
) -> bool:
    """Save ``artifact`` (a ``CompiledArtifact``) under ``key`` with what its compile found about sizes (``Artifact``);
    False (logged) when it cannot be saved."""

    def write(binary: Path) -> None:
        artifact.save(path=str(binary), format="binary")

    extra = {"served": list(served), "guards": list(guards), "dropped": [list(entry) for entry in dropped]}
    return _write(directory / f"{key}.bin", "compiled artifact", key, write, **extra)


def load_plan(directory: Path, key: str) -> Any:
    """The build plan pickled under ``key``, or None (absent, or stale or corrupt: then logged and removed)."""
    return _read(directory / f"{key}.plan", "build plan", key, lambda binary, _: pickle.loads(binary.read_bytes()))


def discard_plan(directory: Path, key: str, why: str) -> None:
    """Log and remove the plan saved under ``key`` (it loaded but cannot serve)."""
    binary = directory / f"{key}.plan"
    _discard([binary, binary.with_name(binary.name + ".json")], "build plan", why)


def save_plan(directory: Path, key: str, plan: Any) -> bool:
    """Pickle ``plan`` under ``key``; False (logged) when it cannot be saved."""
    payload = pickle.dumps(plan)
    return _write(directory / f"{key}.plan", "build plan", key, lambda binary: binary.write_bytes(payload))
