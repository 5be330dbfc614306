"""Tier 3, the tier of last resort: a vision tower that neither the whole-tower graph nor block graphs can serve
(its blocks themselves change shape with the items: LFM3-VL's convolution blocks loop over ``grid_thw.tolist()``;
blocks that do not attend over packed rows) is served by its own forward compiled at each call's exact sizes, or by
the stock tower for the calls where that code measured slower.

How:
1. A call is keyed by its signature (``call_signature``): each tensor argument's shape, dtype and device, the values
   of the small integer tensors a tower reads on the host (a grid, target sizes), every other argument as it is.
2. The first call of a signature checks the input: the pixel argument and the grid's form, then the stock tower
   runs the call as written, and a call it fails on raises a ValueError naming that error before anything is
   compiled. Then the tower's forward runs through ``torch.compile`` (inductor; dynamo alone with
   ``compiler="eager"``), in a function with a trace cache of its own (``own_code``). Dynamo guards what it traced
   on the call's sizes and host values: the first signature compiles at its exact sizes, the next compiles again
   with what changed symbolic (automatic dynamic shapes), and later signatures run that code where its guards hold
   (a loop over the items keeps a trace per item count). A frame past dynamo's recompile limit runs as written.
3. Which path serves the signature: ``call_choice="exact_size"``, the compiled code; ``"stock"``, the stock tower;
   otherwise the one measured faster on that first call (the compiled code right after its compile, then the stock
   tower, one timed run each: CUDA events on CUDA, the host clock on the CPU), the compiled code on a tie. A
   signature whose compile fails is served by the stock tower, with the error logged once.
4. The signatures are an LRU of ``max_signatures`` entries: the least recently used goes first, and its next call
   is checked and measured again.

Invariant: a call returns what the stock tower returns for it (dynamo's guards pick the trace that runs, and what it
cannot trace runs as written), so a segment's rows depend on that segment only wherever the stock tower's do; the
compiled code runs a signature only after the stock tower ran it without error.
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.hf.interface.packed_tower import grid_argument
from vgraph_compile.hf.stand_in import TowerStandIn, first_line
from vgraph_compile.hf.whole_graph.tower_call import own_code
from vgraph_compile.serve.call_costs import median_ms

__all__ = ["CompiledExactSizeTower", "call_signature", "compile_exact_size_tower"]

log = logging.getLogger(__name__)

HOST_VALUES = 64
"""Integer tensors of at most this many elements are keyed by their values (a grid of up to 21 items, target
sizes): a tower reads them on the host and its code changes with them."""
DEFAULT_MAX_SIGNATURES = 64


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """The key of a call (module docstring, step 1): equal for two calls that run the same code."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            small_ints = not leaf.is_floating_point() and not leaf.is_complex() and leaf.numel() <= HOST_VALUES
            values = _tuples(leaf.tolist()) if small_ints else None
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device, values))
        else:
            key.append((type(leaf), leaf if _hashable(leaf) else repr(leaf)))
    return tuple(key)


def _tuples(values: Any) -> Any:
    return tuple(_tuples(value) for value in values) if isinstance(values, list) else values


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _describe(key: tuple) -> str:
    """A signature as the stats show it: each tensor's shape, and the values of those keyed by value."""
    parts = []
    for part in key[1:]:
        if len(part) == 4:
            shape, _, _, values = part
            parts.append(str(values) if values is not None else "x".join(map(str, shape)) or "scalar")
    return ", ".join(parts)


def _compiled_call(tower: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    return tower(*args, **kwargs)


@dataclass
class _Signature:
    """What serves one signature, and why."""

    serves: Literal["compiled code", "stock tower"]
    why: str
    compiled_ms: float | None = None
    stock_ms: float | None = None


class CompiledExactSizeTower(TowerStandIn):
    """A tower served by its compiled code at each call's exact sizes (see the module docstring): call it as the
    tower. ``tier_reason`` says why the better tiers could not serve it. Calls with grad enabled or in training
    mode run the stock tower."""

    tier = "exact-size code"

    def __init__(
        self, tower: torch.nn.Module, config: VGraphConfig, tier_reason: str, max_signatures: int
    ) -> None:
        super().__init__(tower)
        if max_signatures < 1:
            raise ValueError(f"max_signatures={max_signatures}: keep at least one signature")
        self.vgraph_config = config
        self.tier_reason = tier_reason
        """Why neither the whole-tower graph nor block graphs serve this tower (each tier's reason)."""
        self.max_signatures = max_signatures
        self.signature = inspect.signature(tower.forward)
        self.grid_argument = grid_argument(tower)
        self.stock_calls = 0
        """Calls the stock tower served (grad or training mode, a signature measured faster stock, a failed
        compile)."""
        self.compiled_calls = 0
        """Calls the compiled code served."""
        self._lock = threading.Lock()
        """Held around each read and write of ``signatures``."""
        self._first_calls = threading.Lock()
        """Held by a signature's first call: one compile and one measurement at a time."""
        self._reset()

    def _reset(self) -> None:
        """A fresh trace cache and no signatures: the tower's tensors changed."""
        backend = "inductor" if self.vgraph_config.compiler == "inductor" else "eager"
        self.__dict__["compiled"] = torch.compile(own_code(_compiled_call), backend=backend, dynamic=None)
        self.__dict__["signatures"] = collections.OrderedDict()

    def _runtimes(self) -> list:
        """No vgraph runtime: the compiled code runs without buckets."""
        return []

    def _stats_table(self) -> str:
        with self._lock:
            entries = list(self.signatures.items())
        compiled = sum(entry.serves == "compiled code" for _, entry in entries)
        lines = [
            f"tier: exact-size code (the tower's forward compiled at each call's sizes, or the stock tower where "
            f"that measured slower); the better tiers could not serve it: {self.tier_reason}",
            f"signatures: {len(entries)} kept (at most {self.max_signatures}), {compiled} served by the compiled "
            f"code, {len(entries) - compiled} by the stock tower; calls: {self.compiled_calls} compiled, "
            f"{self.stock_calls} stock",
        ]
        for key, entry in entries:
            lines.append(f"  {_describe(key)}: {entry.serves} ({entry.why})")
        return "\n".join(lines)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training or torch.is_grad_enabled():
            self.stock_calls += 1
            return self.tower(*args, **kwargs)
        key = call_signature(args, kwargs)
        entry = self._entry(key)
        if entry is None:
            with self._first_calls:
                entry = self._entry(key)
                if entry is None:
                    return self._first_call(key, args, kwargs)
        return self._run(entry, args, kwargs)

    def _entry(self, key: tuple) -> _Signature | None:
        with self._lock:
            entry = self.signatures.get(key)
            if entry is not None:
                self.signatures.move_to_end(key)
            return entry

    def _run(self, entry: _Signature, args: tuple, kwargs: dict) -> Any:
        if entry.serves == "compiled code":
            self.compiled_calls += 1
            counters.exact_size_calls += 1
            return self.compiled(self.tower, args, kwargs)
        self.stock_calls += 1
        return self.tower(*args, **kwargs)

    def _check(self, args: tuple, kwargs: dict) -> None:
        """A ValueError naming what is wrong with the call's form: its arguments against the tower's signature,
        the pixel argument (a tensor on the tower's device), the grid (a ``[items, 3]`` integer tensor of positive
        sizes)."""
        name = type(self.tower).__name__
        try:
            arguments = self.signature.bind(*args, **kwargs).arguments
        except TypeError as error:
            raise ValueError(f"{name}.forward{self.signature}: {error}") from None
        pixel_argument, pixels = next(iter(arguments.items()))
        device = next(self.tower.parameters()).device
        if not isinstance(pixels, torch.Tensor):
            raise ValueError(f"{pixel_argument} must be a torch.Tensor, got {type(pixels).__name__}")
        if pixels.device != device:
            raise ValueError(
                f"{pixel_argument} is on {pixels.device} but the tower is on {device}: move it with "
                f"{pixel_argument}.to(tower.device)"
            )
        grid = arguments.get(self.grid_argument) if self.grid_argument else None
        if grid is None:
            return
        if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ValueError(
                f"{self.grid_argument} must be a [items, 3] integer tensor of (t, h, w), got "
                f"{getattr(grid, 'dtype', '')} {tuple(getattr(grid, 'shape', ())) or grid!r}"
            )
        if grid.numel() and int(grid.min()) <= 0:
            raise ValueError(f"{self.grid_argument} = {grid.tolist()}: every t, h, w must be positive")

    def _first_call(self, key: tuple, args: tuple, kwargs: dict) -> Any:
        """Check the call, run it stock, compile and measure it (module docstring, steps 2 and 3), keep the
        signature; returns the output of the path that serves it."""
        self._check(args, kwargs)
        name = type(self.tower).__name__
        try:
            stock = self.tower(*args, **kwargs)
        except Exception as error:
            raise ValueError(
                f"{name} fails on this call as written ({first_line(error)}), so vgraph compiles nothing for it: "
                "pass the inputs its processor makes"
            ) from error
        output, entry = self._serve_signature(args, kwargs)
        with self._lock:
            self.signatures[key] = entry
            if len(self.signatures) > self.max_signatures:
                self.signatures.popitem(last=False)
        log.info("%s: the call signature %s is served by the %s (%s)", name, _describe(key), entry.serves, entry.why)
        if entry.serves == "compiled code":
            self.compiled_calls += 1
            counters.exact_size_calls += 1
            return output
        self.stock_calls += 1
        return stock

    def _serve_signature(self, args: tuple, kwargs: dict) -> tuple[Any, _Signature]:
        """(the compiled code's output, or None, and what serves the signature)."""
        choice = self.vgraph_config.call_choice
        if choice == "stock":
            return None, _Signature("stock tower", "call_choice='stock'")
        try:
            output = self.compiled(self.tower, args, kwargs)
        except Exception as error:
            log.warning("%s: its compile failed at these sizes (%s); the stock tower serves them",
                        type(self.tower).__name__, first_line(error))  # fmt: skip
            return None, _Signature("stock tower", f"the compile failed: {first_line(error)}")
        if choice == "exact_size":
            return output, _Signature("compiled code", "call_choice='exact_size'")
        device = next(self.tower.parameters()).device
        compiled_ms = median_ms(lambda: self.compiled(self.tower, args, kwargs), device, repeats=1, warm=False)
        stock_ms = median_ms(lambda: self.tower(*args, **kwargs), device, repeats=1, warm=False)
        serves = "compiled code" if compiled_ms <= stock_ms else "stock tower"
        return output, _Signature(serves, f"measured {compiled_ms:.3f} ms compiled, {stock_ms:.3f} ms stock",
                                  compiled_ms, stock_ms)  # fmt: skip


def compile_exact_size_tower(
    tower: torch.nn.Module,
    tier_reason: str,
    token_budgets: list[int] | tuple[int, ...] | None = None,
    max_signatures: int = DEFAULT_MAX_SIGNATURES,
    **options: Any,
) -> CompiledExactSizeTower:
    """Serve ``tower`` by its compiled code at each call's exact sizes (see the module docstring).

    ``options`` are ``VGraphConfig`` fields; this tier reads ``compiler`` and ``call_choice`` (``"exact_size"``:
    always the compiled code, ``"stock"``: always the stock tower, otherwise measured per signature) and takes
    ``token_budgets`` and the rest for the tiers above it. ``max_signatures`` bounds the signatures kept.
    ``tier_reason`` is why the better tiers do not serve it.
    """
    config = VGraphConfig(token_budgets=tuple(token_budgets) if token_budgets is not None else None, **options)
    return CompiledExactSizeTower(tower, config, tier_reason, max_signatures)
