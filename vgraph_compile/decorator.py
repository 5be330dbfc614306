"""``vgraph_compile.encoder``: compile an encoder's forward (function or module) with the vgraph backend.

It is ``torch.compile(fn, backend=VGraphBackend(config), dynamic=True, fullgraph=True)`` under
``trace_options()``: one trace with symbolic token and segment sizes serves every call, and a graph break is an
error rather than a silent slow path. The returned callable exposes ``.vgraph`` (the backend, with its runtimes
and their stats).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
from torch.fx.experimental import _config as fx_config

from vgraph_compile.backend import VGraphBackend
from vgraph_compile.config import VGraphConfig

__all__ = ["encoder", "trace_options"]

F = TypeVar("F", bound=Callable[..., Any])


def trace_options():
    """ShapeEnv settings for a trace that serves every size, whatever the first call was.

    No duck sizing: a token count equal to a feature width by chance must not tie the two. Size-oblivious
    backed sizes: a first call with one token or one segment must not specialize that size to 1.
    """
    return fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)


def encoder(fn: F | None = None, /, *, config: VGraphConfig | None = None, **options: Any):
    """Decorate a forward (or wrap a module): ``@vgraph_compile.encoder(token_budgets=[1024, 4096])``.

    ``options`` are ``VGraphConfig`` fields; pass either them or ``config``.
    """
    if config is not None and options:
        raise ValueError(f"pass either config= or VGraphConfig fields, not both (got {sorted(options)})")
    config = config or VGraphConfig.from_options(options)

    def wrap(target: F) -> F:
        backend = VGraphBackend(config)
        compiled = torch.compile(target, backend=backend, dynamic=True, fullgraph=True)

        @functools.wraps(target)
        def call(*args: Any, **kwargs: Any) -> Any:
            with trace_options():
                return compiled(*args, **kwargs)

        call.vgraph = backend
        return call

    return wrap(fn) if fn is not None else wrap
