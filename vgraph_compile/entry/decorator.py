"""``vgraph_compile.encoder``: compile an encoder's forward (function or module) with the vgraph backend.

The first call traces with ``torch.compile(fn, backend=VGraphBackend(config), dynamic=True, fullgraph=True)``
under ``trace_options()``: one trace with symbolic token and segment sizes serves every call, and a graph break
is an error rather than a silent slow path. Later calls skip dynamo: the call's arguments are read into the
graph's inputs (``serve/arguments``) and the runtime validates, fills, replays and narrows. A call the trace
cannot tell apart without a retrace (another argument structure, another specialized constant) goes through
dynamo again. A call with autograd enabled on trainable parameters or inputs runs the encoder as written.
The returned callable exposes ``.vgraph`` (the backend, with its runtimes and their stats).

Warm start: the first call first looks for a build plan saved by an earlier process for the same encoder, config
and call structure (``vgraph_compile.entry.warm_start``) and, with one, serves from it with no trace and no compile.
After a first trace the plan is saved for later processes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Callable

import torch

from vgraph_compile.analyze import ANALYSES, Analyses
from vgraph_compile.entry.backend import VGraphBackend
from vgraph_compile.entry.trace_options import trace_options
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.serve.arguments import CallArguments, OutputLayout
from vgraph_compile.serve.runtime import StockServed, VGraphRuntime
from vgraph_compile.entry import warm_start

__all__ = ["encoder", "CompiledEncoderFunction"]

log = logging.getLogger(__name__)


def refuse_int_lists(forward: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """A ``ValueError`` naming the first argument that is a list of ints (``cu_seqlens`` given as
    ``[0, 5, 12]``): dynamo would bake its length into the trace (a retrace per segment count) and an attention
    op takes offsets as a tensor, so it is refused before anything is traced, with the conversion to make."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs).arguments
    except TypeError:
        return  # the encoder's own call reports it
    for name, value in bound.items():
        if isinstance(value, list) and value and all(type(item) is int for item in value):
            raise ValueError(
                f"{name} is a Python list of {len(value)} ints ({value[:4]}{'...' if len(value) > 4 else ''}): "
                f"vgraph traces tensors, whose sizes may change from call to call; pass "
                f"{name}=torch.tensor({name}, dtype=torch.int32, device=...) (offsets are int32 on the tokens' device)"
            )


class _HotPath:
    """One runtime called straight from the encoder's arguments, past dynamo's guards: the aligned parameters
    padded past their first dim become views of the graphs' tensors too (``CompiledEncoder.share_strided``). With a
    cost table, the runtime may serve a call by ``stock``, the encoder as written, on the call's own arguments."""

    def __init__(
        self, runtime: VGraphRuntime, arguments: CallArguments, layout: OutputLayout, stock: Callable[..., Any]
    ) -> None:
        self.runtime, self.arguments, self.layout, self.stock = runtime, arguments, layout, stock
        runtime.encoder.share_strided()

    def __call__(self, args: tuple, kwargs: dict, key: Any = None) -> Any:
        inputs = self.arguments.read(args, kwargs, key)
        if inputs is None:
            return NotImplemented
        stock = functools.partial(self.stock, *args, **kwargs) if self.runtime.offers_stock else None
        outputs = self.runtime(*inputs, key=key, stock=stock)
        return outputs.result if isinstance(outputs, StockServed) else self.layout.build(outputs)


class CompiledEncoderFunction:
    """What ``vgraph_compile.encoder`` returns: call it like the encoder."""

    def __init__(
        self,
        target: Callable[..., Any],
        config: VGraphConfig,
        analyses: Analyses = ANALYSES,
        around_trace: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        agree_buckets: Callable[[set[int]], set[int]] | None = None,
    ) -> None:
        """``around_trace``: entered around every call that goes through dynamo (the first trace, any retrace)
        and around a call run as written, never on the hot path: what the trace must see whichever call traces
        (the HF towers' attention routing, ``hf.attention.routed_attention``). ``agree_buckets``: every runtime's
        (``VGraphRuntime.agree_buckets``)."""
        self.target = target
        self._around_trace = around_trace
        self.vgraph = VGraphBackend(config, keep_first_outputs=True, analyses=analyses, agree_buckets=agree_buckets)
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

    def capture_all(self) -> None:
        """Return once every graph of this encoder's runtimes is captured (by default they are captured behind the
        first call: ``VGraphConfig.captures``), capturing what is left now; nothing before the first call."""
        for runtime in self.vgraph.runtimes:
            runtime.warmup()

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
        refuse_int_lists(self._forward, args, kwargs)
        with self._trace_lock, self._around_trace():
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
        self._hot = _HotPath(runtime, arguments, layout, self.target)
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
        arguments = CallArguments.from_trace(
            runtime.input_sources, runtime.fixed_inputs, self._forward, runtime.pinned_sources
        )
        layout = OutputLayout.match(result, first)
        if arguments is None or layout is None:
            return None
        arguments.remember(args, kwargs)
        return _HotPath(runtime, arguments, layout, self.target)


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
