"""``vgraph_compile.encoder``: compile an encoder's forward (function or module) with the vgraph backend.

It is ``torch.compile(fn, backend=VGraphBackend(config), dynamic=True, fullgraph=True)`` under
``trace_options()``: one trace with symbolic token and segment sizes serves every call, and a graph break is an
error rather than a silent slow path. The returned callable exposes ``.vgraph`` (the backend, with its runtimes
and their stats).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import torch
from torch.fx.experimental import _config as fx_config

from vgraph_compile.backend import VGraphBackend
from vgraph_compile.config import VGraphConfig

__all__ = ["encoder", "trace_options"]

F = TypeVar("F", bound=Callable[..., Any])


def trace_options(args: tuple = ()) -> contextlib.ExitStack:
    """Settings for a trace that serves every size, whatever the first call was.

    Dim 0 of every tensor argument is its packed dim and stays dynamic; trailing dims (feature widths) are
    marked static. No duck sizing: sizes equal by chance in the first call (as many windows as frames, a token
    count equal to a width) must not be tied together; lengths that are equal by construction are related by
    the graph itself (an elementwise op, or ``torch._check(a.shape[0] == b.shape[0])``). Size-oblivious backed
    sizes: a first call with one token or one segment must not specialize that size to 1. Specialized floats:
    module constants (eps, scales) stay constants rather than becoming graph inputs.
    """
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 1:
            torch._dynamo.mark_static(arg, tuple(range(1, arg.dim())))
    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(use_duck_shape=False, backed_size_oblivious=True))
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    return stack


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
            with trace_options(args):
                return compiled(*args, **kwargs)

        call.vgraph = backend
        return call

    return wrap(fn) if fn is not None else wrap
