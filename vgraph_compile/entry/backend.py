"""The ``"vgraph"`` torch.compile backend.

``torch.compile(m, backend="vgraph", dynamic=True, options={...})`` finds ``vgraph_backend`` through the
``torch_dynamo_backends`` entry point; ``VGraphBackend(config)`` is the same backend as an object that keeps the
runtimes it built (``vgraph_compile.encoder`` uses it).

Inside dynamo's call of the backend, the pipeline's stages run in order (``vgraph_compile/pipeline``). A trace
built before, in this process or an earlier one, is served from its saved graph plan instead (``warm_start``):
only the checks and the assembly run. The stages run here, not later: aot_autograd and inductor signal dynamo to
trace again (``TensorifyScalarRestartAnalysis``, recompiles) by raising, and only dynamo's call of the backend
catches those. The returned ``VGraphRuntime`` captures the buckets' CUDA graphs at its first call (captures raise
no such signal).

cuDNN attention is off while dynamo traces (``trace_options``) and the compile runs with the setting the caller
had (``VGraphBackend.cudnn_attention``): SDPA's cuDNN check of a mask asks whether its batch dim is 1, which under
tracing becomes a guard ``N != 1`` that excludes a bucket of one tile, although it only chooses a kernel. The
compile chooses again, on the rewritten graph (whose all-True masks are dropped).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils.weak import WeakIdKeyDictionary

from vgraph_compile import pipeline
from vgraph_compile.analyze import ANALYSES, Analyses
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters, startup_phases
from vgraph_compile.entry import warm_start
from vgraph_compile.serve.arguments import argument_rooted, pinned_sources
from vgraph_compile.serve.runtime import VGraphRuntime
from vgraph_compile.spec import PassContext, Role, StaticTokensError, user_name
from vgraph_compile.symbolic import evaluate, traced_values

__all__ = ["vgraph_backend", "VGraphBackend", "runtimes"]

log = logging.getLogger(__name__)

_RUNTIMES: "weakref.WeakSet[VGraphRuntime]" = weakref.WeakSet()
_FIRST_TRACES: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
"""Per encoder (its first parameter): the signature of its first dynamic trace, for the retrace warning."""


def runtimes() -> list[VGraphRuntime]:
    """Every live runtime the backend built in this process, oldest first."""
    return sorted(_RUNTIMES, key=lambda runtime: runtime.serial)


def _is_dynamic(example_inputs: list[Any]) -> bool:
    return any(
        isinstance(value, torch.SymInt)
        or (isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape))
        for value in example_inputs
    )


def _device(example_inputs: list[Any]) -> torch.device:
    inputs = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    if not inputs:
        raise ValueError("the traced encoder takes no tensor input: nothing for vgraph to bucket")
    activations = [value for value in inputs if not isinstance(value, torch.nn.Parameter)]
    return (activations or inputs)[0].device


def _first_call(example_inputs: list[Any], shape_env) -> list[Any]:
    """The values of the call being traced: dynamo passes its tensors, and its sizes as symbols (read here by
    their traced values, so checking them adds no guard)."""
    traced = traced_values(shape_env)
    return [
        evaluate(value.node.expr, traced, "a traced size") if isinstance(value, torch.SymInt) else value
        for value in example_inputs
    ]


def _trace_signature(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> dict[str, str]:
    """What dynamo guards on that a user changes: grad mode, and each activation's dtype, device, rank and layout."""
    signature = {"grad mode": "enabled" if torch.is_grad_enabled() else "disabled"}
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            signature[user_name(node.name)] = f"{value.dtype} on {value.device}, {value.dim()}-D, {value.layout}"
    return signature


class VGraphBackend:
    """The vgraph backend with a fixed config; keeps the runtimes it built, in order."""

    def __init__(
        self,
        config: VGraphConfig | None = None,
        keep_first_outputs: bool = False,
        analyses: Analyses = ANALYSES,
        agree_buckets: Callable[[set[int]], set[int]] | None = None,
    ) -> None:
        self.config = config or VGraphConfig()
        self.analyses = analyses
        """The analyses run on each trace: ``ANALYSES`` (varlen encoders) or ``TILE_ANALYSES`` (fixed tiles)."""
        self.keep_first_outputs = keep_first_outputs
        """Runtimes keep their first call's outputs (for ``vgraph_compile.encoder`` to map its return value)."""
        self.agree_buckets = agree_buckets
        """Given to every runtime it keeps (``VGraphRuntime.agree_buckets``)."""
        self.cudnn_attention: bool | None = None
        """The caller's cuDNN attention setting, for the build, when dynamo traced with it off; None: unchanged."""
        self.runtimes: list[VGraphRuntime] = []
        self._static_warned = False

    @staticmethod
    def _warn_retrace(example_inputs: list[Any], signature: dict[str, str]) -> None:
        """A later dynamic trace of the same encoder (known by its first parameter): say what changed since its
        first trace and what it costs (a compile and captures of its own)."""
        owner = next((value for value in example_inputs if isinstance(value, torch.nn.Parameter)), None)
        if owner is None:
            return
        first = _FIRST_TRACES.setdefault(owner, signature)
        if first is signature:
            return
        changed = [
            f"{name}: {first.get(name, 'absent')} -> {value}"
            for name, value in signature.items()
            if first.get(name) != value
        ]
        log.warning(
            "vgraph traced the encoder again: %s. Each trace compiles and captures its own graphs (seconds to a "
            "minute on a GPU); keep calls in one grad mode, dtype and layout to avoid it",
            "; ".join(changed) or "a static dim or a specialized argument changed",
        )

    def _static_trace(self, gm: torch.fx.GraphModule, why: str) -> Callable[..., Any]:
        """A trace that serves one token count: run it as traced, warn once; dynamo retraces on the next size."""
        counters.static_traces += 1
        if not self._static_warned:
            self._static_warned = True
            log.warning("%s Until then the encoder runs eagerly.", why)
        return gm.forward

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if not _is_dynamic(example_inputs) and not self.config.static_rows:
            return self._static_trace(
                gm,
                "vgraph got a trace with static shapes. Pass dynamic=True to torch.compile (or use "
                "vgraph_compile.encoder) to compile the token buckets on the first call.",
            )
        fake_mode = detect_fake_mode(example_inputs)
        ctx = PassContext(
            example_inputs=list(example_inputs),
            shape_env=fake_mode.shape_env,
            config=self.config,
            device=_device(example_inputs),
        )
        first_call = _first_call(example_inputs, ctx.shape_env)
        key = warm_start.graph_key(gm, ctx, self.analyses)
        with startup_phases.phase("plan_load"):
            loaded = warm_start.load_graph(self.config, key) if key is not None else None
        if loaded is not None:
            spec, record, compiled = loaded
            state = [value if role.role is Role.PARAMETER else None for role, value in zip(spec.inputs, example_inputs)]
            built = pipeline.build_from_plan(self.config, spec, record, compiled, state, first_call)
        else:
            try:
                built = pipeline.build(gm, ctx, first_call, self.analyses, self.cudnn_attention)
            except StaticTokensError as error:
                return self._static_trace(gm, str(error))
            if key is not None:
                warm_start.save_graph(self.config, key, built.spec, built.record)
        counters.traces += 1
        if not self.config.static_rows:  # a static trace is made on purpose, beside its encoder's dynamic one
            self._warn_retrace(example_inputs, _trace_signature(gm, example_inputs))
        sources = [getattr(node.meta.get("grapharg"), "source", None) for node in gm.graph.find_nodes(op="placeholder")]
        fixed = [
            None if source is not None and argument_rooted(source) else value
            for source, value in zip(sources, ctx.example_inputs)
        ]
        runtime = VGraphRuntime(built.encoder, built.checks, ctx.device, fixed, sources, self.keep_first_outputs)
        runtime.pinned_sources = pinned_sources()
        self.adopt(runtime)
        return runtime

    def adopt(self, runtime: VGraphRuntime) -> None:
        """Keep ``runtime`` with this backend's (a runtime this backend built, or one assembled from a saved plan)."""
        runtime.agree_buckets = self.agree_buckets
        self.runtimes.append(runtime)
        _RUNTIMES.add(runtime)


def vgraph_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable[..., Any]:
    """Entry point for ``torch.compile(backend="vgraph", options={...})``; options are ``VGraphConfig`` fields."""
    if mode not in (None, "default"):
        raise ValueError(
            f"vgraph takes no torch.compile mode (got {mode!r}): it always captures CUDA graphs on CUDA; "
            "use options={'cudagraphs': False} to turn them off"
        )
    return VGraphBackend(VGraphConfig.from_options(options))(gm, example_inputs)
