"""The pipeline: one table that owns the stage order, from a dynamo trace to an encoder that serves every call.

Before any stage, the entry point traces the encoder under ``entry/trace_options`` (dynamic token dims, static
widths, no duck sizing): one trace, symbolic in every token and segment size. Then, inside dynamo's call of the
backend, ``STAGES`` run in order:

==========  ========================  ==============================================================================
stage       where                     why here
==========  ========================  ==============================================================================
analyze     ``analyze/``              what the trace is (input roles, attention groups, per-bucket sizes), read before
                                      anything changes it; a bad encoder or budget fails here
check_call  ``serve/call_checks``     the call being traced takes the checks every call takes, so bad input is
                                      refused before anything compiles; a ``cudagraphs`` setting that cannot hold too
rewrite     ``rewrite/``              the kernel choice (timed on a GPU), then the eager copy and the copy to compile
                                      rewritten; after the analyses, whose records the rewrites read
compile     ``compile/inductor``      one inductor compile for every bucket, inside dynamo's call: aot_autograd and
                                      inductor signal a retrace by raising, which only dynamo catches
assemble    ``compile/assemble``      parameters bound, kernels prepared, every bucket's buffers allocated; last, as
                                      a warm start runs it alone on a saved record
==========  ========================  ==============================================================================

A saved plan (``entry/warm_start``) holds what analyze, rewrite and compile decided: a warm start runs
``PLAN_STAGES`` only. CUDA graphs are captured at the first call (``serve/runtime``), outside this table. Each
stage is timed (``counters.startup_phases``, under its name); ``build`` calls them in the table's order, by name, so a reader (and a test)
follows the trace through each once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.fx

from vgraph_compile.analyze import Analyses, analyze
from vgraph_compile.compile.assemble import BuildRecord, CompiledEncoder, assemble, cudagraphs_wanted, input_layout
from vgraph_compile.compile.inductor import CompiledFn, compile_once
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import startup_phases
from vgraph_compile.rewrite import Rewritten, rewrite_trace
from vgraph_compile.serve.call_checks import CallChecks
from vgraph_compile.spec import PassContext, Role, VarlenSpec

__all__ = ["Built", "PLAN_STAGES", "STAGES", "Stage", "build", "build_from_plan", "cudnn_attention"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Built:
    """What the stages made of one trace (or of a saved plan)."""

    spec: VarlenSpec
    checks: CallChecks
    record: BuildRecord
    encoder: CompiledEncoder


class Stage(NamedTuple):
    name: str
    function: str
    """The name of the function in this module that runs the stage."""


STAGES: tuple[Stage, ...] = (
    Stage("analyze", "analyze_trace"),
    Stage("check_call", "check_call"),
    Stage("rewrite", "rewrite"),
    Stage("compile", "compile_trace"),
    Stage("assemble", "assemble_encoder"),
)
"""The stages of a trace, in the order ``build`` runs them (module docstring: where each lives, and why there)."""

PLAN_STAGES: tuple[Stage, ...] = (STAGES[1], STAGES[4])
"""The stages a saved plan leaves to run (``build_from_plan``)."""

def _timed(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The stage's wall time, under its name, in ``counters.startup_phases`` (start-up reports read it)."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with startup_phases.phase(name):
                return function(*args, **kwargs)

        return timed

    return wrap


@_timed("analyze")
def analyze_trace(gm: torch.fx.GraphModule, ctx: PassContext, analyses: Analyses) -> VarlenSpec:
    return analyze(gm, ctx, analyses).spec


@_timed("check_call")
def check_call(checks: CallChecks, first_call: list[Any] | None) -> None:
    if first_call is not None:
        checks.check(first_call)


@_timed("rewrite")
def rewrite(gm: torch.fx.GraphModule, ctx: PassContext) -> Rewritten:
    return rewrite_trace(gm, ctx)


@_timed("compile")
def compile_trace(
    rewritten: Rewritten, ctx: PassContext, cudagraphs: bool, cudnn: bool | None
) -> tuple[CompiledFn, BuildRecord]:
    with contextlib.nullcontext() if cudnn is None else cudnn_attention(cudnn):
        result = compile_once(rewritten.compiled, ctx)
    record = BuildRecord(
        eager=rewritten.eager,
        layout=input_layout(rewritten.compiled, ctx.spec),
        shapes=tuple(result.shapes),
        cudagraphs=cudagraphs,
        kernels=rewritten.kernels,
        folded=rewritten.folded,
        prepared=rewritten.prepared,
        artifact_key=result.artifact_key,
        graph=rewritten.compiled if ctx.config.compiler == "eager" else None,
        size_guards=result.guards,
        dropped=tuple(ctx.dropped),
    )
    return result.run, record


@_timed("assemble")
def assemble_encoder(spec: VarlenSpec, record: BuildRecord, compiled: CompiledFn, state: list[Any]) -> CompiledEncoder:
    return assemble(spec, record, compiled, state)


def build(
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    first_call: list[Any],
    analyses: Analyses,
    cudnn: bool | None = None,
) -> Built:
    """Run ``STAGES`` on a dynamo trace; ``gm`` is left as traced. ``cudnn``: the caller's cuDNN attention setting
    for the compile, when dynamo traced with it off (None: unchanged). Raises what a stage refuses (a ValueError
    that says what to fix; ``StaticTokensError`` for a trace with no dynamic token dim)."""
    spec = analyze_trace(gm, ctx, analyses)
    checks = CallChecks.from_context(ctx)
    check_call(checks, first_call)
    cudagraphs = cudagraphs_wanted(ctx)
    rewritten = rewrite(gm, ctx)
    compiled, record = compile_trace(rewritten, ctx, cudagraphs, cudnn)
    parameters = [value if role.role is Role.PARAMETER else None for role, value in zip(spec.inputs, ctx.example_inputs)]
    return Built(spec, checks, record, assemble_encoder(spec, record, compiled, parameters))


def build_from_plan(
    config: VGraphConfig,
    spec: VarlenSpec,
    record: BuildRecord,
    compiled: CompiledFn,
    state: list[Any],
    first_call: list[Any] | None = None,
) -> Built:
    """Run ``PLAN_STAGES`` on what a saved plan decided: its checks (of ``first_call``, when there is one) and its
    assembly over ``state`` (per graph input, the live module's parameter or buffer; None elsewhere)."""
    checks = CallChecks(spec, config, record.layout.copied)
    check_call(checks, first_call)
    return Built(spec, checks, record, assemble_encoder(spec, record, compiled, state))


@contextlib.contextmanager
def cudnn_attention(enabled: bool) -> Iterator[None]:
    """SDPA's cuDNN backend on or off inside the block, restored after it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
