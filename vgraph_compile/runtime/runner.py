"""``VGraphRuntime``: what the vgraph backend returns to dynamo for one traced encoder.

Per call: read the real sizes from the inputs, validate (before any graph runs), choose the smallest bucket
that holds every size, fill the bucket's persistent buffers by each input's padding rule, run or replay the
bucket graph, and return the outputs narrowed to the real sizes (copied out of the graph's memory).
A call no bucket holds runs the traced graph eagerly, counted and logged once; so does a call that needs
autograd (bucket graphs are inference-only).
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import sympy
import torch
import torch.fx
from tqdm.auto import tqdm

from vgraph_compile.counters import counters
from vgraph_compile.passes import lower_packed, pass_manager
from vgraph_compile.passes.pad_varlen import select_backend
from vgraph_compile.passes.spec import BucketShape, PassContext, Role
from vgraph_compile.passes.specialize import buffer_name
from vgraph_compile.runtime import cudagraph, padding

__all__ = ["VGraphRuntime", "BucketStats", "padded_fraction"]

log = logging.getLogger(__name__)

_COPIED_ROLES = {role for role in Role if role in padding.RULES}
_SERIALS = itertools.count(1)


@dataclass
class BucketStats:
    budget: int
    hits: int = 0
    real_tokens: int = 0
    """Sum over hits of the real token rows."""

    @property
    def padded_fraction(self) -> float:
        """Share of the bucket's rows that were padding, over its hits."""
        return padded_fraction([self])


def padded_fraction(stats: Iterable[BucketStats]) -> float:
    """Share of the rows that were padding, over every hit of these buckets."""
    stats = list(stats)
    capacity = sum(bucket.hits * bucket.budget for bucket in stats)
    return 1.0 - sum(bucket.real_tokens for bucket in stats) / capacity if capacity else 0.0


@dataclass
class _Bucket:
    shape: BucketShape
    module: torch.fx.GraphModule
    """The static graph (owner of the buffers), for inspection."""
    run: cudagraph.StaticFn
    buffers: dict[int, torch.Tensor]
    stats: BucketStats


@dataclass
class _Miss:
    reason: str
    count: int = 0


class VGraphRuntime:
    """Token-budget bucket graphs for one dynamo trace, and the eager trace as fallback."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        self.serial = next(_SERIALS)
        self.name = f"vgraph encoder #{self.serial}"
        self.ctx = ctx
        self.spec = ctx.spec
        self.config = ctx.config
        self.cudagraphs = (
            ctx.device.type == "cuda" and self.config.compiler == "inductor"
            if self.config.cudagraphs is None
            else self.config.cudagraphs
        )
        if self.cudagraphs and (ctx.device.type != "cuda" or self.config.compiler != "inductor"):
            raise ValueError(
                f"cudagraphs=True needs a CUDA encoder compiled with inductor (device {ctx.device}, "
                f"compiler {self.config.compiler!r}): set cudagraphs=None or compiler='inductor'"
            )
        self.traced = gm
        """The dynamic trace, which every bucket graph is specialized from."""
        self.eager = copy.deepcopy(gm)
        """The trace with the configured kernels, run as is for calls no bucket serves."""
        select_backend(self.eager, ctx)
        pass_manager.apply_pass("lower_packed", lower_packed.run, self.eager, ctx)
        self.buckets: list[_Bucket] = []
        self.misses: dict[str, _Miss] = {}
        self._lock = threading.Lock()
        self._parameters_need_grad = any(
            isinstance(value, torch.Tensor) and value.requires_grad for value in ctx.example_inputs
        )
        self._offsets = [role for role in self.spec.inputs if role.role is Role.SEGMENT_OFFSETS]
        self._copied = [role for role in self.spec.inputs if role.role in _COPIED_ROLES]

    # -- build -------------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Build, compile and (with CUDA graphs) capture every bucket, largest first; idempotent."""
        with self._lock:
            if self.buckets:
                return
            built = []
            shapes = sorted(self.ctx.buckets, key=lambda bucket: -bucket.budget)
            for shape in tqdm(shapes, desc=f"vgraph: compiling {self.name}", unit="bucket", leave=False):
                static = pass_manager.build_bucket_graph(self.traced, self.ctx, shape)
                buffers = {
                    role.index: getattr(static, buffer_name(role.index))
                    for role in self._copied
                    if hasattr(static, buffer_name(role.index))
                }
                run = cudagraph.compile_static(static, self.config, self.cudagraphs)
                built.append(_Bucket(shape, static, run, buffers, BucketStats(shape.budget)))
            if self.cudagraphs:
                cudagraph.capture([bucket.run for bucket in built])
            self.buckets = sorted(built, key=lambda bucket: bucket.shape.budget)
            log.info("%s: %d buckets ready %s", self.name, len(built), [b.shape.budget for b in self.buckets])

    # -- per call ----------------------------------------------------------------------------------------------
    def sizes(self, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """The real value of every bound symbol, read from the call's inputs."""
        return {
            symbol: int(args[index]) if dim is None else args[index].shape[dim]
            for symbol, index, dim in self.spec.bindings
        }

    def tokens(self, substitution: dict[sympy.Symbol, sympy.Integer]) -> int:
        """The call's token count (rows of the first attention), the quantity budgets are counted in."""
        return int(self.spec.token_rows.xreplace(substitution))

    def _validate(self, args: Sequence[Any], tokens: int) -> None:
        for role in self._offsets:
            offsets = args[role.index]
            if offsets.dim() != 1 or offsets.shape[0] < 2:
                raise ValueError(
                    f"{role.name}: cu_seqlens must be 1-D with at least 2 entries [0, ..., tokens], "
                    f"got shape {tuple(offsets.shape)}"
                )
            if not self.config.check_values:
                continue
            values = offsets.tolist()
            if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != tokens:
                raise ValueError(
                    f"{role.name}: cu_seqlens must start at 0, never decrease and end at the token count "
                    f"{tokens}; got {values[:8]}{'...' if len(values) > 8 else ''} ending at {values[-1]}. "
                    "Build it as F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)"
                )

    @staticmethod
    def _violating(shape: BucketShape, sizes: dict[sympy.Symbol, int]) -> Iterator[tuple[sympy.Symbol, int, int]]:
        """(symbol, real size, bucket size) for each size that keeps a call out of ``shape``: a bounded size over
        its bound, or a pinned size that differs. Lazy, so the fit check stops at the first."""
        for symbol, value in shape.values.items():
            real = sizes.get(symbol, value)
            if real != value if symbol in shape.fixed else real > value:
                yield symbol, real, value

    def _choose(self, sizes: dict[sympy.Symbol, int]) -> _Bucket | None:
        return next((b for b in self.buckets if next(self._violating(b.shape, sizes), None) is None), None)

    def _miss(self, reason: str, args: Sequence[Any], detail: str = "") -> Any:
        miss = self.misses.setdefault(reason, _Miss(reason))
        if miss.count == 0:
            log.warning("%s: %s%s; running it eagerly (logged once per reason)", self.name, reason, detail)
        miss.count += 1
        counters.eager_fallbacks += 1
        return self.eager(*args)

    def _narrow(self, outputs: Sequence[Any], substitution: dict[sympy.Symbol, sympy.Integer]) -> list[Any]:
        results = []
        for output, shape in zip(outputs, self.spec.outputs):
            if isinstance(shape, tuple) and isinstance(output, torch.Tensor):
                for dim, size in enumerate(shape):
                    if size.free_symbols:
                        output = output.narrow(dim, 0, int(size.xreplace(substitution)))
                output = output.clone()
            elif isinstance(shape, sympy.Expr):
                output = int(shape.xreplace(substitution))
            results.append(output)
        return results

    def __call__(self, *args: Any) -> list[Any]:
        sizes = self.sizes(args)
        substitution = {symbol: sympy.Integer(value) for symbol, value in sizes.items()}
        tokens = self.tokens(substitution)
        self._validate(args, tokens)
        if torch.is_grad_enabled() and (
            self._parameters_need_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        ):
            return self._miss("autograd is enabled (vgraph graphs are inference-only: use torch.no_grad())", args)
        self.warmup()
        bucket = self._choose(sizes)
        if bucket is None:
            largest = self.buckets[-1].shape
            over = sorted(self._violating(largest, sizes), key=lambda violation: str(violation[0]))
            reason = "no bucket holds " + ", ".join(self.spec.describe(symbol) for symbol, _, _ in over)
            detail = ", ".join(
                f"{self.spec.describe(symbol)}={real} {'!=' if symbol in largest.fixed else '>'} {value}"
                for symbol, real, value in over
            )
            return self._miss(reason, args, f" ({detail})")
        for role in self._copied:
            if role.index in bucket.buffers:
                padding.fill(role.role, bucket.buffers[role.index], args[role.index])
        outputs = cudagraph.run_static(bucket.run, self.cudagraphs)
        bucket.stats.hits += 1
        bucket.stats.real_tokens += tokens
        counters.replays += 1
        return self._narrow(outputs, substitution)

    # -- reporting ---------------------------------------------------------------------------------------------
    def stats_table(self) -> str:
        """Per-bucket hits and padding, and the eager fallbacks, as a printable table."""
        lines = [f"{'budget':>8} {'segments':>9} {'max_seqlen':>11} {'hits':>6} {'padded':>7}"]
        for bucket in self.buckets:
            stats = bucket.stats
            lines.append(
                f"{stats.budget:>8} {str(list(bucket.shape.segments)):>9} "
                f"{str(list(bucket.shape.max_seqlen)):>11} {stats.hits:>6} {stats.padded_fraction:>7.1%}"
            )
        for miss in self.misses.values():
            lines.append(f"eager fallback x{miss.count}: {miss.reason}")
        return "\n".join(lines)

    @property
    def hits(self) -> int:
        return sum(bucket.stats.hits for bucket in self.buckets)
