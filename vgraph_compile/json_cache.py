"""JSON files of measured or derived values kept across processes (kernel timings, padding costs, the sources'
digest), under inductor's cache directory.

Invariant: a file is replaced atomically, merged with what another process wrote meanwhile, so processes starting
together (one per rank) neither read a half-written file nor drop each other's entries, except a key both wrote
(the last write wins). A missing or unreadable file reads as empty; a file that cannot be written is logged and
skipped (the values are measured again next time).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

__all__ = ["cache_path", "load", "merge"]

log = logging.getLogger(__name__)


def cache_path(name: str) -> str:
    """``name`` under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), name)


def load(path: str) -> dict:
    """The file's entries (empty when it is missing or unreadable)."""
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def merge(path: str, entries: dict) -> None:
    """Merge ``entries`` into the file, replaced atomically (module docstring)."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        merged = {**load(path), **entries}
        handle, scratch = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(merged, file, indent=1)
        os.replace(scratch, path)
    except OSError as failure:
        log.info("%s not written: %s", path, failure)
