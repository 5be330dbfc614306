"""Warm start: a later process serves an encoder from its saved build plan, with no dynamo trace and no compile.

After the first trace of an encoder (``vgraph_compile.encoder``, which ``compile_vision_tower`` goes through), its
``BuildPlan`` is saved beside the compiled artifact (``compile/artifacts``): the spec, the build's record (eager
fallback graph, bucket shapes, buffer layout, kernel choice, folded scalars, the artifact's key), the names of
the module's parameters and buffers the graph reads, and the decorator's argument paths and output layout. A
later process computes the plan's key from the encoder and its first call, before anything traces; with a plan
under that key it loads the compiled code, binds the live module's own parameters and buffers by name, rebuilds
the per-call checks from the spec (bad input raises the same ValueErrors) and serves. Its ``counters.traces``
and ``counters.compiles`` do not move, and dynamo compiles no frame.

Key (``plan_key``): everything that changes what the trace and the build make, other than graph inputs: the
module tree (each module's class, the source file of every class, its plain attributes and config, each
parameter's and buffer's name, shape, strides, dtype, device and requires_grad), the first call's structure
(each tensor's dtype, device, rank and trailing dims; every other value but ints, which may be sizes), grad mode,
the config (all but ``artifact_dir``), dynamo's and inductor's configs, the torch version, the optional kernel
packages' versions (a plan chosen among the plain install's kernels is not loaded after the GPU install), the vgraph
sources and the device. Never the weights: the plan binds the live module's tensors. A plan that cannot be loaded, or whose
compiled artifact or module state is gone, is logged, removed and built again by tracing; never used.

Through ``torch.compile(backend="vgraph")`` dynamo traces before it calls any backend, so a later process cannot
skip that trace; the backend skips the rest. Each build also saves a ``GraphPlan`` (the spec and the build's
record) under ``graph_key``: the hash of the traced graph's code and inputs (dtype, shape in the trace's symbols,
strides, device), the analyses, the config, grad mode, dynamo's and inductor's configs, the torch version, the
optional kernel packages' versions, the vgraph sources and the device. A later backend call on the same trace serves from it with no analyses, no
rewrites and no compile, binding the parameters dynamo passes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx

from vgraph_compile import pipeline
from vgraph_compile.compile import artifacts
from vgraph_compile.compile.assemble import BuildRecord
from vgraph_compile.compile.inductor import CompiledFn, load_compiled
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.kernels import registry
from vgraph_compile.serve.arguments import CallArguments, OutputLayout
from vgraph_compile.serve.runtime import VGraphRuntime
from vgraph_compile.spec import PassContext, VarlenSpec

__all__ = ["BuildPlan", "GraphPlan", "graph_key", "load", "load_graph", "plan_key", "save", "save_graph"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildPlan:
    """What serving an encoder needs besides its compiled code and its module's tensors; picklable."""

    spec: VarlenSpec
    record: BuildRecord
    device: str
    state: dict[int, str]
    """Graph input -> the name of the module parameter or buffer it is (``named_parameters``/``named_buffers``)."""
    constants: dict[int, Any]
    """Graph input -> its value, for the other inputs not read from the call's arguments."""
    paths: list[tuple | None]
    """Per graph input: where the decorator reads it from a call's arguments (``CallArguments.paths``)."""
    fingerprint: Any
    """The traced call's structure and specialized constants (``CallArguments.fingerprint``)."""
    pinned: frozenset[str] | None
    """The argument sources the trace specialized (``CallArguments.pinned``), which the fingerprint reads."""
    outputs: OutputLayout


@dataclass(frozen=True)
class GraphPlan:
    """What the backend needs, besides the compiled code, to serve a trace it built before; picklable."""

    spec: VarlenSpec
    record: BuildRecord


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_plain(key) and _plain(item) for key, item in value.items())
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))


@functools.cache
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _source(item: Any) -> str:
    """The hash of the file a class or function is defined in (its code, whatever it calls there)."""
    try:
        return _file_hash(inspect.getsourcefile(item))
    except (TypeError, OSError):
        return getattr(item, "__qualname__", type(item).__qualname__)


def _module(target: Any) -> dict[str, Any]:
    """The module tree of ``target`` as the trace depends on it (the key's first part); a function: its code."""
    if not isinstance(target, torch.nn.Module):
        return {"function": f"{target.__module__}.{target.__qualname__}", "source": _source(target)}
    modules, configs = [], {}
    for name, module in target.named_modules(remove_duplicate=False):
        kind = type(module)
        attributes = sorted(
            f"{key}={value!r}" for key, value in vars(module).items() if not key.startswith("_") and _plain(value)
        )
        config = getattr(module, "config", None)
        if config is not None and id(config) not in configs:
            configs[id(config)] = json.dumps(config.to_dict() if hasattr(config, "to_dict") else repr(config),
                                             sort_keys=True, default=str)  # fmt: skip
        modules.append([name, f"{kind.__module__}.{kind.__qualname__}", _source(kind), attributes])
    state = [
        [kind, name, str(value.dtype), tuple(value.shape), value.stride(), str(value.device), value.requires_grad]
        for kind, named in (("parameter", target.named_parameters), ("buffer", target.named_buffers))
        for name, value in named(remove_duplicate=False)
    ]
    return {"modules": modules, "configs": sorted(configs.values()), "state": state}


def _call(value: Any) -> Any:
    """A call argument as the trace depends on it: structure, tensors' metadata, values other than ints."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), str(value.device), value.dim(), tuple(value.shape[1:]), value.requires_grad]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_call(item) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[repr(key), _call(item)] for key, item in value.items()]]
    if isinstance(value, int) and not isinstance(value, bool):
        return "int"
    return [type(value).__qualname__, repr(value)]


def _environment(config: VGraphConfig, device: torch.device) -> dict[str, Any]:
    """What both keys hash besides the encoder and its call: the config, grad mode, torch's configs, the versions of
    torch and of the optional kernel packages, and the device."""
    return {
        "grad": torch.is_grad_enabled(),
        "config": repr(dataclasses.replace(config, artifact_dir=None)),
        "dynamo": artifacts.settings(torch._dynamo.config),
        "inductor": artifacts.settings(torch._inductor.config),
        "torch": torch.__version__,
        "kernels": registry.installed_packages(),
        "vgraph": artifacts.sources_hash(),
        "device": artifacts.device_name(device),
    }


def _hash(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def plan_key(target: Any, config: VGraphConfig, args: tuple, kwargs: dict) -> str | None:
    """The key of the build plan of ``target`` first called with ``args`` and ``kwargs`` (the module docstring's
    list); None when plans are off (no artifact directory) or the call has no tensor."""
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    if not tensors or artifacts.artifact_dir(config) is None:
        return None
    return _hash({
        "module": _module(target),
        "args": [_call(value) for value in args],
        "kwargs": sorted([name, _call(value)] for name, value in kwargs.items()),
        **_environment(config, tensors[0].device),
    })  # fmt: skip


def graph_key(gm: torch.fx.GraphModule, ctx: PassContext, analyses: Sequence[tuple[str, Any]]) -> str | None:
    """The key of the ``GraphPlan`` of the trace ``gm`` (the module docstring's list); None when plans are off."""
    if artifacts.artifact_dir(ctx.config) is None:
        return None
    inputs = [
        f"{artifacts.describe_input(value)} {getattr(value, 'requires_grad', '')}" for value in ctx.example_inputs
    ]
    return _hash({
        "graph": gm.code,
        "inputs": inputs,
        "analyses": [name for name, _ in analyses],
        **_environment(ctx.config, ctx.device),
    })  # fmt: skip


def save_graph(config: VGraphConfig, key: str, spec: VarlenSpec, record: BuildRecord) -> None:
    """Save the ``GraphPlan`` of a build under ``key``, when its compiled code is on disk."""
    if record.artifact_key is None and record.graph is None:
        return
    if artifacts.save_plan(artifacts.artifact_dir(config), key, GraphPlan(spec, record)):
        counters.plans_saved += 1


def load_graph(config: VGraphConfig, key: str) -> tuple[VarlenSpec, BuildRecord, CompiledFn] | None:
    """The spec, build record and compiled code of the ``GraphPlan`` saved under ``key``; None when there is none
    (or it is unusable: then logged and removed)."""
    loaded = _load(config, key, GraphPlan)
    if loaded is None:
        return None
    plan, compiled = loaded
    log.info("vgraph: serving the trace from the graph plan %s (no analyses, no compile)", key)
    return plan.spec, plan.record, compiled


def _load(
    config: VGraphConfig, key: str, kind: type, refusal: Callable[[Any], str | None] | None = None
) -> tuple[Any, CompiledFn] | None:
    """The plan of ``kind`` saved under ``key`` and the compiled code its record names; None when there is none,
    and when it is of another kind, ``refusal`` gives a reason against it, or its compiled code is gone (then
    logged and removed)."""
    directory = artifacts.artifact_dir(config)
    plan = artifacts.load_plan(directory, key)
    if plan is None:
        return None
    why = None if isinstance(plan, kind) else f"holds a {type(plan).__name__}, not a {kind.__name__}"
    if why is None and refusal is not None:
        why = refusal(plan)
    compiled = _compiled(config, plan.record) if why is None else None
    if why is None and compiled is None:
        why = f"needs the compiled artifact {plan.record.artifact_key}, which is gone"
    if why is not None:
        artifacts.discard_plan(directory, key, why)
        return None
    counters.plans_loaded += 1
    return plan, compiled


def _compiled(config: VGraphConfig, record: BuildRecord) -> CompiledFn | None:
    """The compiled code a record names: its graph run as is, or its loaded artifact; None when that is gone."""
    if record.graph is not None:
        graph = record.graph
        return lambda inputs: graph(*inputs)
    loaded = load_compiled(config, record.artifact_key)
    return loaded[0] if loaded is not None else None


def _state(target: Any) -> dict[str, torch.Tensor]:
    if not isinstance(target, torch.nn.Module):
        return {}
    return {
        **dict(target.named_parameters(remove_duplicate=False)),
        **dict(target.named_buffers(remove_duplicate=False)),
    }


def save(
    config: VGraphConfig, key: str, target: Any, runtime: VGraphRuntime, arguments: CallArguments, outputs: OutputLayout
) -> bool:
    """Save the plan of ``runtime`` (traced from ``target``'s first call) under ``key``; False (logged) when its
    compiled code is not on disk or the graph reads a tensor that is not the module's own state."""
    record = runtime.encoder.record
    if record.artifact_key is None and record.graph is None:
        log.info("vgraph: no build plan saved: the compiled encoder is not on disk")
        return False
    names = {id(value): name for name, value in _state(target).items()}
    state, constants = {}, {}
    for index, value in enumerate(runtime.fixed_inputs):
        if isinstance(value, torch.Tensor):
            if id(value) not in names:
                log.info("vgraph: no build plan saved: the graph reads a tensor that is not the module's state "
                         "(a global or a closure's)")  # fmt: skip
                return False
            state[index] = names[id(value)]
        elif value is not None:
            constants[index] = value
    shapes = tuple(bucket.shape for bucket in runtime.buckets) if runtime.encoder.captured else record.shapes
    plan = BuildPlan(
        spec=runtime.spec,
        record=dataclasses.replace(record, shapes=shapes),
        device=str(runtime.device),
        state=state,
        constants=constants,
        paths=arguments.paths,
        fingerprint=arguments.fingerprint,
        pinned=arguments.pinned,
        outputs=outputs,
    )
    saved = artifacts.save_plan(artifacts.artifact_dir(config), key, plan)
    counters.plans_saved += saved
    return saved


def load(
    config: VGraphConfig, key: str, target: Any, forward: Callable[..., Any]
) -> tuple[VGraphRuntime, CallArguments, OutputLayout] | None:
    """The runtime, argument readers and output layout of the plan saved under ``key``, over the live module's
    tensors; None when there is none (or it is unusable: then logged and removed)."""
    state = _state(target)

    def refusal(plan: BuildPlan) -> str | None:
        missing = sorted(name for name in plan.state.values() if name not in state)
        return f"reads module state the encoder no longer has ({missing[:3]})" if missing else None

    loaded = _load(config, key, BuildPlan, refusal)
    if loaded is None:
        return None
    plan, compiled = loaded
    record = plan.record
    bound: list[Any] = [None] * len(plan.spec.inputs)
    for index, name in plan.state.items():
        bound[index] = state[name]
    built = pipeline.build_from_plan(config, plan.spec, record, compiled, bound)
    fixed = list(bound)
    for index, value in plan.constants.items():
        fixed[index] = value
    runtime = VGraphRuntime(built.encoder, built.checks, torch.device(plan.device), fixed)
    arguments = CallArguments.over(forward, plan.paths, fixed, plan.pinned)
    arguments.fingerprint = plan.fingerprint
    log.info("vgraph: serving from the build plan %s (no trace, no compile)", key)
    return runtime, arguments, plan.outputs
