"""Process-wide event counters of the vgraph backend, and the wall time of each start-up phase, for tests, logs
and benchmarks.

``counters.expect(**deltas)`` checks, in a ``with`` block, that exactly those counters moved by exactly that much
(counters not named must not move). ``startup_phases.seconds`` holds, per phase (``PHASES``), the wall seconds
spent in it in this process, exclusive of the phases nested in it (the trace holds the analyses, the compile and
the captures, which are counted under their own names only); the device is synchronized at each phase's end, so
the GPU work a phase queued is counted in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["PHASES", "Counters", "StartupPhases", "counters", "startup_phases"]


@dataclass
class Counters:
    traces: int = 0
    """Dynamo graphs the backend received with a dynamic token dimension."""
    static_traces: int = 0
    """Dynamo graphs received with static shapes (run as traced, see the warning they log)."""
    sites_found: int = 0
    """Varlen-attention call sites discovered."""
    nodes_rewritten: int = 0
    """Graph nodes changed by rewrite passes (all buckets)."""
    compiles: int = 0
    """Inductor compiles: one per trace, whatever the number of buckets."""
    blocks_compiled_once: int = 0
    """Blocks inductor ran as calls of their class's one compiled subgraph (``compile/repeated_blocks``)."""
    artifacts_saved: int = 0
    """Compiled encoders saved for later processes (``compile/artifacts``)."""
    artifacts_loaded: int = 0
    """Compiled encoders loaded from a saved artifact instead of compiled (no inductor compile)."""
    plans_saved: int = 0
    """Build plans saved for later processes (``entry/warm_start``)."""
    plans_loaded: int = 0
    """Encoders served from a saved build plan: no trace, no analyses, no compile."""
    probe_forwards: int = 0
    """Eager forwards run to learn a packed tower's interface (``hf/interface/packed_tower``; none when it is loaded)."""
    interfaces_loaded: int = 0
    """Packed towers' interfaces loaded from a saved entry instead of probed (``hf/interface/tower_interfaces``)."""
    padding_costs_loaded: int = 0
    """Runtimes whose padding costs were loaded, saved with their compiled code, instead of timed
    (``serve/call_costs``)."""
    buckets_built: int = 0
    """Buckets given buffers (each runs the one compiled graph at its sizes)."""
    graphs_captured: int = 0
    """CUDA graphs recorded (one per bucket when cudagraphs are on)."""
    graphs_uploaded: int = 0
    """Captured graphs the driver uploaded at capture (``compile/buckets.upload``), so their first replay does not."""
    buckets_dropped: int = 0
    """Buckets given up: a guard of the compiled code fails at their sizes, or out of GPU memory at capture."""
    replays: int = 0
    """Calls served by a bucket graph."""
    served_before_capture: int = 0
    """Calls served while their bucket's graph was still to be captured behind the calls (``VGraphConfig.captures``):
    the compiled code at their exact sizes, or on the bucket's buffers without a graph."""
    eager_fallbacks: int = 0
    """Calls that fit no bucket and ran the traced graph eagerly."""
    exact_size_calls: int = 0
    """Calls a tower's forward compiled at the call's exact sizes served (the tier of last resort:
    ``hf/exact_size/exact_size_tower``)."""

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        before = self.snapshot()
        yield
        after = self.snapshot()
        moved = {name: after[name] - before[name] for name in after if after[name] != before[name]}
        expected = {name: delta for name, delta in deltas.items() if delta}
        if moved != expected:
            raise AssertionError(f"counter changes {moved} != expected {expected}")


counters = Counters()


PHASES = {
    "interface": "a packed tower's interface: probed on its shrunk tower, or loaded (``hf/interface/tower_interfaces``)",
    "plan_load": "a saved build plan or graph plan and its compiled artifact loaded (``warm_start``)",
    "trace": "dynamo's trace and what the backend does besides the stages below",
    "analyze": "the pipeline's analyses: sites, roles, relations and bounds (``analyze``)",
    "check_call": "the pipeline's checks of the call being traced (``serve/call_checks``)",
    "rewrite": "the pipeline's rewrites of the eager and the compiled copy (``rewrite``)",
    "kernel_timing": "the attention kernel chosen per group by timing the candidates (``rewrite/kernel_choice``)",
    "compile": "the pipeline's one inductor compile, or the load of its saved artifact (``compile_once``)",
    "assemble": "the pipeline's assembly: parameters bound, kernels prepared, buffers allocated",
    "captures": "every bucket's CUDA graph captured, largest first (``compile/buckets.capture``)",
    "padding_costs": "what padding rows cost against a call at its exact sizes, measured at warm-up on CUDA "
    "(``serve/call_costs.PaddingCosts``)",
    "call_costs": "the cost table of the ways to serve a call, measured at warm-up (``serve/call_costs``)",
}
"""The start-up phases ``startup_phases`` times, and what each holds."""


@dataclass
class StartupPhases:
    """Wall seconds per start-up phase (``PHASES``) in this process, each exclusive of the phases nested in it."""

    seconds: dict[str, float] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the block's wall time (device synchronized at its end), less that of phases nested in it, to
        ``seconds[name]``."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}: one of {sorted(PHASES)}")
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            nested = stack.pop()
            if stack:
                stack[-1] += elapsed
            with self._lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - nested

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seconds)


startup_phases = StartupPhases()
