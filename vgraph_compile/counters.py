"""Process-wide event counters of the vgraph backend, for tests and logs.

``counters.expect(**deltas)`` checks, in a ``with`` block, that exactly those counters moved by exactly that much
(counters not named must not move).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Counters", "counters"]


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
    eager_fallbacks: int = 0
    """Calls that fit no bucket and ran the traced graph eagerly."""

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
