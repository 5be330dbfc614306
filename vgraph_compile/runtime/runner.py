"""``VGraphRuntime``: serves the calls of one traced encoder from the buckets its build made.

Per call: read the real sizes from the inputs, validate them (before anything runs), choose the smallest bucket
that holds every size, then, holding the runtime's lock: fill the bucket's buffers by each input's padding rule,
replay (or run) the bucket, narrow the outputs to the real sizes and copy them out. A call no bucket holds runs
the traced graph eagerly, counted and logged once per reason; so does a call that needs autograd (the buckets
are inference-only).

Concurrency: the lock covers fill to copy-out, so callers on several threads never see each other's rows. On
CUDA the lock is released once the work is queued, not finished; the next caller's stream waits for the previous
call's copy-out (a CUDA event) before its fill, so callers on different streams are ordered too. The returned
tensors are safe to read on the caller's stream.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import sympy
import torch

from vgraph_compile.graphs import CompiledEncoder
from vgraph_compile.graphs.buckets import Bucket, BucketStats, padded_fraction
from vgraph_compile.graphs.padding import fill
from vgraph_compile.counters import counters
from vgraph_compile.passes.fx_utils import evaluate
from vgraph_compile.passes.spec import BucketShape, PassContext, Role
from vgraph_compile.runtime.arguments import argument_rooted

__all__ = ["VGraphRuntime", "BucketStats", "padded_fraction"]

log = logging.getLogger(__name__)

_SERIALS = itertools.count(1)


@dataclass
class _Miss:
    reason: str
    count: int = 0


@dataclass(frozen=True)
class _Plan:
    """What a call's sizes decide, computed once per distinct sizes (sympy stays off the hot path)."""

    key: tuple[int, ...]
    sizes: dict[sympy.Symbol, int]
    tokens: int
    ends: dict[int, int]
    """Per offsets input (by index): the row count its last entry must equal, where the graph states one."""
    narrow: tuple[tuple[tuple[int, int], ...] | int | None, ...]
    """Per output: (dim, real size) pairs to narrow a tensor to, its value for an int output, or None."""


_PLAN_CACHE_SIZE = 4096


@dataclass(frozen=True)
class _TensorContract:
    """What the trace assumed of a tensor input: checked per call, since the hot path skips dynamo's guards."""

    index: int
    name: str
    dtype: torch.dtype
    device: torch.device
    static: tuple[int | None, ...]
    """Per dim: its fixed size, or None where it varies with the call."""


class VGraphRuntime:
    """Token-budget buckets for one dynamo trace, and the eager trace as fallback."""

    def __init__(
        self,
        build: Callable[[], CompiledEncoder],
        ctx: PassContext,
        sources: Sequence[Any],
        keep_first_outputs: bool = False,
    ) -> None:
        self.serial = next(_SERIALS)
        self.name = f"vgraph encoder #{self.serial}"
        self._build = build
        self._encoder: CompiledEncoder | None = None
        self._build_lock = threading.Lock()
        self.spec = ctx.spec
        self.config = ctx.config
        self.device = ctx.device
        self.misses: dict[str, _Miss] = {}
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._chosen: dict[tuple[int, ...], Bucket | None] = {}
        """The bucket chosen per call sizes, kept once the graphs are captured (a capture may drop buckets)."""
        self._lock = threading.Lock()
        self._done: torch.cuda.Event | None = None
        self._parameters_need_grad = any(
            isinstance(value, torch.Tensor) and value.requires_grad for value in ctx.example_inputs
        )
        self._offsets = [role for role in self.spec.inputs if role.role is Role.SEGMENT_OFFSETS]
        self._max_seqlen = {
            group.offsets_input: group.max_seqlen_inputs for group in self.spec.groups if group.max_seqlen_inputs
        }
        self._contracts = [
            _TensorContract(
                role.index,
                self.spec.describe_input(role.index),
                value.dtype,
                value.device,
                tuple(int(size) if not getattr(size, "free_symbols", ()) else None for size in shape),
            )
            for role, value, shape in zip(self.spec.inputs, ctx.example_inputs, self.spec.input_shapes)
            if isinstance(value, torch.Tensor) and role.role is not Role.PARAMETER
        ]
        self.input_sources = list(sources)
        """Dynamo's source of each graph input (None where it has none)."""
        self.fixed_inputs = [
            None if source is not None and argument_rooted(source) else value
            for source, value in zip(self.input_sources, ctx.example_inputs)
        ]
        """The traced value of each input not read from the call's arguments (parameters, module state)."""
        self.serves = 0
        """Calls served (by a bucket or eagerly)."""
        self._keep_first_outputs = keep_first_outputs
        self.first_outputs: list[Any] | None = None
        """With ``keep_first_outputs``: the outputs of the first call served (the decorator maps them to what the
        encoder returns, then drops them); no other call's outputs are kept."""

    @property
    def encoder(self) -> CompiledEncoder:
        """The compiled graph and its buckets, built at the first call that passes validation (so bad input is
        refused before anything compiles)."""
        if self._encoder is None:
            with self._build_lock:
                if self._encoder is None:
                    self._encoder = self._build()
        return self._encoder

    @property
    def buckets(self) -> list[Bucket]:
        return self.encoder.buckets

    def warmup(self) -> bool:
        """Capture every bucket's graph now (the first valid call does it otherwise). True when this call captured."""
        if self.encoder.captured:
            return False
        self.encoder.warmup()
        return True

    # -- per call ----------------------------------------------------------------------------------------------

    def _plan(self, args: Sequence[Any]) -> _Plan:
        key = tuple(int(args[index]) if dim is None else args[index].shape[dim] for _, index, dim in self.spec.bindings)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        sizes = dict(zip((symbol for symbol, _, _ in self.spec.bindings), key))
        narrow = []
        for shape in self.spec.outputs:
            if isinstance(shape, tuple):
                narrow.append(
                    tuple(
                        (dim, evaluate(size, sizes, "an output size"))
                        for dim, size in enumerate(shape)
                        if size.free_symbols
                    )
                )
            elif isinstance(shape, sympy.Expr):
                narrow.append(evaluate(shape, sizes, "an int output"))
            else:
                narrow.append(None)
        ends = {
            group.offsets_input: evaluate(group.ends_at, sizes, "where cu_seqlens ends")
            for group in self.spec.groups
            if group.ends_at is not None
        }
        tokens = evaluate(self.spec.token_rows, sizes, "the token rows")
        plan = _Plan(key, sizes, tokens, ends, tuple(narrow))
        if len(self._plans) >= _PLAN_CACHE_SIZE:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _check_contract(self, args: Sequence[Any]) -> None:
        for contract in self._contracts:
            value = args[contract.index]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{contract.name} must be a tensor, got {type(value).__name__}")
            if value.dtype != contract.dtype or value.device != contract.device:
                raise ValueError(
                    f"{contract.name} is {value.dtype} on {value.device}, but the encoder was compiled for "
                    f"{contract.dtype} on {contract.device}: convert it with "
                    f"{contract.name}.to(device='{contract.device}', dtype={contract.dtype})"
                )
            if value.dim() != len(contract.static) or any(
                fixed is not None and size != fixed for size, fixed in zip(value.shape, contract.static)
            ):
                expected = ", ".join("any" if fixed is None else str(fixed) for fixed in contract.static)
                raise ValueError(
                    f"{contract.name} has shape {tuple(value.shape)}, but the encoder takes [{expected}] "
                    "(only the packed dims vary between calls)"
                )

    def _validate(self, args: Sequence[Any], plan: _Plan) -> None:
        self._check_contract(args)
        for role in self._offsets:
            offsets = args[role.index]
            if offsets.dim() != 1 or offsets.shape[0] < 2:
                raise ValueError(
                    f"{self.spec.describe_input(role.index)}: cu_seqlens must be 1-D with at least 2 entries [0, ..., tokens], "
                    f"got shape {tuple(offsets.shape)}"
                )
            if not self.config.check_values:
                continue
            values = offsets.tolist()
            end = plan.ends.get(role.index, values[-1])
            if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != end:
                raise ValueError(
                    f"{self.spec.describe_input(role.index)}: cu_seqlens must start at 0, never decrease and end at the row "
                    f"count {end}; got {values[:8]}{'...' if len(values) > 8 else ''} ending at {values[-1]}. "
                    "Build it as F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)"
                )
            longest = max(b - a for a, b in zip(values, values[1:]))
            for index in self._max_seqlen.get(role.index, ()):
                if longest > args[index]:
                    raise ValueError(
                        f"{self.spec.describe_input(index)}={args[index]} is smaller than the longest "
                        f"segment of {self.spec.describe_input(role.index)} ({longest} rows): pass the longest segment length"
                    )

    @staticmethod
    def _violating(shape: BucketShape, sizes: dict[sympy.Symbol, int]) -> Iterator[tuple[sympy.Symbol, int, int]]:
        """(symbol, real size, bucket size) for each size that keeps a call out of ``shape``: a bounded size over
        its bound, or a pinned size that differs. Lazy, so the fit check stops at the first."""
        for symbol, value in shape.values.items():
            real = sizes.get(symbol, value)
            if symbol in shape.fixed:
                if real != value:
                    yield symbol, real, value
            elif real > value:
                yield symbol, real, value

    def _choose(self, plan: _Plan) -> Bucket | None:
        """The smallest bucket no size of the call exceeds; remembered per sizes once the graphs are captured."""
        if plan.key in self._chosen:
            return self._chosen[plan.key]
        bucket = next((b for b in self.buckets if next(self._violating(b.shape, plan.sizes), None) is None), None)
        if self.encoder.captured:
            if len(self._chosen) >= _PLAN_CACHE_SIZE:
                self._chosen.clear()
            self._chosen[plan.key] = bucket
        return bucket

    def _miss(self, reason: str, args: Sequence[Any], detail: str = "") -> Any:
        miss = self.misses.setdefault(reason, _Miss(reason))
        if miss.count == 0:
            log.warning("%s: %s%s; running it eagerly (logged once per reason)", self.name, reason, detail)
        miss.count += 1
        counters.eager_fallbacks += 1
        outputs = self.encoder.eager(*args)
        self._remember_first(list(outputs))
        return outputs

    def _no_bucket(self, args: Sequence[Any], sizes: dict[sympy.Symbol, int]) -> Any:
        if not self.buckets:
            return self._miss("no bucket was built (see the warnings above)", args)
        largest = self.buckets[-1].shape
        over = sorted(self._violating(largest, sizes), key=lambda violation: str(violation[0]))
        reason = "no bucket holds " + ", ".join(self.spec.describe(symbol) for symbol, _, _ in over)
        detail = ", ".join(
            f"{self.spec.describe(symbol)}={real} {'!=' if symbol in largest.fixed else '>'} {value}"
            for symbol, real, value in over
        )
        return self._miss(reason, args, f" ({detail})")

    def _remember_first(self, outputs: list[Any]) -> None:
        if self.serves == 0 and self._keep_first_outputs:
            self.first_outputs = outputs
        self.serves += 1

    def _fill(self, bucket: Bucket, args: Sequence[Any]) -> None:
        """Fill every buffer of the bucket from this call's arguments. Metadata is copied on every call too: a
        tensor can change without its version counter moving (writes through ``.numpy()`` or ``.data``, a reused
        pinned staging buffer), so no copy is skipped."""
        for index, buffer in bucket.buffers.items():
            fill(self.encoder.roles[index], buffer, args[index])

    @staticmethod
    def _narrow(outputs: Sequence[Any], plan: _Plan) -> list[Any]:
        """The outputs at the call's real sizes, copied out of the bucket's memory."""
        results = []
        for output, narrow in zip(outputs, plan.narrow):
            if isinstance(narrow, tuple) and isinstance(output, torch.Tensor):
                for dim, size in narrow:
                    output = output.narrow(dim, 0, size)
                output = output.clone()
            elif isinstance(narrow, int):
                output = narrow
            results.append(output)
        return results

    def __call__(self, *args: Any) -> list[Any]:
        plan = self._plan(args)
        self._validate(args, plan)
        grad = torch.is_grad_enabled()
        if grad and (self._parameters_need_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self._miss("autograd is enabled (vgraph graphs are inference-only: use torch.no_grad())", args)
        changed = [  # the hot path passes the traced tensor itself: no read of it per call
            index
            for index, value in self.encoder.folded.items()
            if args[index] is not self.fixed_inputs[index] and args[index].item() != value
        ]
        if changed:
            names = ", ".join(self.spec.describe_input(index) for index in changed)
            return self._miss(f"{names} differ from the values the graphs were built with", args)
        self.warmup()
        bucket = self._choose(plan)
        if bucket is None:
            return self._no_bucket(args, plan.sizes)
        with self._lock, torch.no_grad() if grad else contextlib.nullcontext():
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if self._done is not None:
                stream.wait_event(self._done)
            self._fill(bucket, args)
            results = self._narrow(bucket.run(self.encoder.compiled), plan)
            if stream is not None:
                self._done = self._done or torch.cuda.Event()
                self._done.record(stream)
            bucket.stats.hits += 1
            bucket.stats.real_tokens += plan.tokens
            counters.replays += 1
            self._remember_first(results)
        return results

    # -- reporting ---------------------------------------------------------------------------------------------
    def stats_table(self) -> str:
        """Per-bucket hits and padding, pool memory and the eager fallbacks, as a printable table."""
        lines = [
            "budget: token rows the bucket holds; segments, max_seqlen: per attention group; hits: calls served; "
            "padded: share of its rows that were padding",
            f"{'budget':>8} {'segments':>9} {'max_seqlen':>11} {'hits':>6} {'padded':>7}",
        ]
        for bucket in self.buckets:
            stats = bucket.stats
            lines.append(
                f"{stats.budget:>8} {str(list(bucket.shape.segments)):>9} "
                f"{str(list(bucket.shape.max_seqlen)):>11} {stats.hits:>6} {stats.padded_fraction:>7.1%}"
            )
        if self.encoder.kernels:
            kernels = ", ".join(f"group {group}: {name}" for group, name in sorted(self.encoder.kernels.items()))
            lines.append(f"attention kernels: {kernels}")
        if self.encoder.cudagraphs:
            lines.append(f"graph pool: {self.encoder.pool_bytes / 2**20:.1f} MiB for {len(self.buckets)} graphs")
        for miss in self.misses.values():
            lines.append(f"eager fallback x{miss.count}: {miss.reason}")
        return "\n".join(lines)

    @property
    def hits(self) -> int:
        return sum(bucket.stats.hits for bucket in self.buckets)
