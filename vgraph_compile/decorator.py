"""``vgraph_compile.encoder``: compile an encoder's forward (function or module) with the vgraph backend.

The first call traces with ``torch.compile(fn, backend=VGraphBackend(config), dynamic=True, fullgraph=True)``
under ``trace_options()``: one trace with symbolic token and segment sizes serves every call, and a graph break
is an error rather than a silent slow path. Later calls skip dynamo: the call's arguments are read into the
graph's inputs (``serve/arguments``) and the runtime validates, fills, replays and narrows. A call the trace
cannot tell apart without a retrace (another argument structure, another specialized constant) goes through
dynamo again. A call with autograd enabled on trainable parameters or inputs runs the encoder as written.
The returned callable exposes ``.vgraph`` (the backend, with its runtimes and their stats).

Warm start: the first call first looks for a build plan saved by an earlier process for the same encoder, config
and call structure (``vgraph_compile.warm_start``) and, with one, serves from it with no trace and no compile.
After a first trace the plan is saved for later processes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable

import torch
from torch.fx.experimental import _config as fx_config

from vgraph_compile.analyze import ANALYSES, Analyses
from vgraph_compile.compile_backend import VGraphBackend, cudnn_attention
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.serve.arguments import CallArguments, OutputLayout
from vgraph_compile.serve.runtime import VGraphRuntime
from vgraph_compile import warm_start

__all__ = ["encoder", "trace_options", "CompiledEncoderFunction"]

log = logging.getLogger(__name__)


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
    stack.enter_context(cudnn_attention(False))
    return stack


class _HotPath:
    """One runtime called straight from the encoder's arguments, past dynamo's guards: the aligned parameters
    padded past their first dim become views of the graphs' tensors too (``CompiledEncoder.share_strided``)."""

    def __init__(self, runtime: VGraphRuntime, arguments: CallArguments, layout: OutputLayout) -> None:
        self.runtime, self.arguments, self.layout = runtime, arguments, layout
        runtime.encoder.share_strided()

    def __call__(self, args: tuple, kwargs: dict, key: Any = None) -> Any:
        inputs = self.arguments.read(args, kwargs, key)
        if inputs is None:
            return NotImplemented
        return self.layout.build(self.runtime(*inputs, key=key))


class CompiledEncoderFunction:
    """What ``vgraph_compile.encoder`` returns: call it like the encoder."""

    def __init__(self, target: Callable[..., Any], config: VGraphConfig, analyses: Analyses = ANALYSES) -> None:
        self.target = target
        self.vgraph = VGraphBackend(config, keep_first_outputs=True, analyses=analyses)
        self._compiled = torch.compile(target, backend=self.vgraph, dynamic=True, fullgraph=True)
        self._forward = target.forward if isinstance(target, torch.nn.Module) else target
        self._hot: _HotPath | None = None
        self._trainable: bool | None = None
        """Whether the module has parameters that require grad (read on the first call with grad enabled)."""
        self._trace_lock = threading.Lock()
        self._warned_limit = False
        self._plan_key: str | None = None
        """The key of this encoder's build plan, computed at its first call (``warm_start.plan_key``)."""
        self._first_call = True
        functools.update_wrapper(self, self._forward)

    @property
    def traced(self) -> bool:
        """Whether calls skip dynamo now (the first trace is done and its inputs can be read directly)."""
        return self._hot is not None

    def _needs_autograd(self, args: tuple, kwargs: dict) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self._trainable is None:
            module = self.target if isinstance(self.target, torch.nn.Module) else None
            self._trainable = module is not None and any(p.requires_grad for p in module.parameters())
        if self._trainable:
            return True
        values = [*args, *kwargs.values()]
        return any(isinstance(value, torch.Tensor) and value.requires_grad for value in values)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_keyed(None, *args, **kwargs)

    def call_keyed(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        """A call where ``key`` (hashable; None: no promise) promises that every argument but the token rows
        equals that of any earlier call with the same key, so the graphs' metadata buffers are filled by one copy
        of what that call staged (``VGraphRuntime``). The HF towers key their calls by the grid."""
        if self._needs_autograd(args, kwargs):
            return self.target(*args, **kwargs)
        hot = self._hot
        if hot is not None:
            result = hot(args, kwargs, key)
            if result is not NotImplemented:
                return result
        with self._trace_lock:
            self.vgraph.cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()
            if self._first_call:
                self._first_call = False
                with startup_phases.phase("plan_load"):
                    result = self._warm_start(args, kwargs, key)
                if result is not NotImplemented:
                    return result
            try:
                tracing = startup_phases.phase("trace") if self._hot is None else contextlib.nullcontext()
                with trace_options(args), tracing:
                    result = self._compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as failure:
                if isinstance(failure.inner_exception, ValueError):
                    raise failure.inner_exception from None  # bad input, said in the user's names
                raise
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                return self._over_recompile_limit(args, kwargs)
            if self._hot is None and self.vgraph.runtimes:  # the runtime that served this call's trace
                self._hot = self._hot_path(self.vgraph.runtimes[-1], args, kwargs, result)
                if self._hot is not None and self._plan_key is not None:
                    hot = self._hot
                    warm_start.save(self.vgraph.config, self._plan_key, self.target, hot.runtime, hot.arguments,
                                    hot.layout)  # fmt: skip
        return result

    def _warm_start(self, args: tuple, kwargs: dict, key: Any) -> Any:
        """Serve the first call from a saved build plan, when there is one; NotImplemented otherwise (the call
        traces, and the plan is saved under the key computed here)."""
        config = self.vgraph.config
        self._plan_key = warm_start.plan_key(self.target, config, args, kwargs)
        if self._plan_key is None:
            return NotImplemented
        loaded = warm_start.load(config, self._plan_key, self.target, self._forward)
        if loaded is None:
            return NotImplemented
        runtime, arguments, layout = loaded
        self.vgraph.adopt(runtime)
        self._hot = _HotPath(runtime, arguments, layout)
        return self._hot(args, kwargs, key)

    def _over_recompile_limit(self, args: tuple, kwargs: dict) -> Any:
        """Dynamo refuses another trace of this forward (its recompile limit): run it as written, counted."""
        counters.eager_fallbacks += 1
        if not self._warned_limit:
            self._warned_limit = True
            log.warning(
                "vgraph: dynamo's recompile limit (torch._dynamo.config.recompile_limit) is reached for %s; calls "
                "that need a new trace run eagerly. Reuse one compiled encoder instead of compiling the same forward "
                "many times, or raise the limit",
                getattr(self._forward, "__qualname__", self._forward),
            )
        return self.target(*args, **kwargs)

    def _hot_path(self, runtime: VGraphRuntime, args: tuple, kwargs: dict, result: Any) -> _HotPath | None:
        """The hot path over the runtime this call traced, when its inputs and outputs can be mapped."""
        first, runtime.first_outputs = runtime.first_outputs, None
        if first is None:
            return None
        arguments = CallArguments.from_trace(runtime.input_sources, runtime.fixed_inputs, self._forward)
        layout = OutputLayout.match(result, first)
        if arguments is None or layout is None:
            return None
        arguments.remember(args, kwargs)
        return _HotPath(runtime, arguments, layout)


def encoder(fn: Callable[..., Any] | None = None, /, *, config: VGraphConfig | None = None, **options: Any):
    """Decorate a forward (or wrap a module): ``@vgraph_compile.encoder(token_budgets=[1024, 4096])``.

    ``options`` are ``VGraphConfig`` fields; pass either them or ``config``.
    """
    if config is not None and options:
        raise ValueError(f"pass either config= or VGraphConfig fields, not both (got {sorted(options)})")
    config = config or VGraphConfig.from_options(options)

    def wrap(target: Callable[..., Any]) -> CompiledEncoderFunction:
        return CompiledEncoderFunction(target, config)

    return wrap(fn) if fn is not None else wrap
