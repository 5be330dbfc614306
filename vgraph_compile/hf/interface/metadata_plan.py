"""Which grid-only metadata a packed vision tower needs, learned from one eager forward, and computed on the host.

transformers' packed towers take every data-dependent input from ``get_*`` functions with a ``kwargs`` parameter
(``transformers.vision_utils.get_vision_cu_seqlens``, ``get_max_seqlen``, a family's own
``get_vision_frame_index``...): each pops its precomputed value from the caller's kwargs under its own key when
it is there. ``record_metadata`` runs the tower once on a probe grid with those functions wrapped in the tower's
modeling modules, and with a ``TorchFunctionMode`` that follows every tensor derived from the grid. It returns a
``MetadataPlan``: per call, the function, its arguments as recipes over the grid (config scalars stay constants),
and the keys it pops, in order, matching its results. ``MetadataPlan.compute(grid)`` replays the calls on the
host for any grid. The tower's config, passed to a call (``get_max_seqlen(cu_seqlens, config)`` reads its attention
implementation), is recorded as the plan's ``config`` input, not as a constant: ``MetadataPlan.bound(config)``
gives the plan that reads another tower's config (the plan is learned on a shrunk tower of the same class and
config, and saved without it).

Invariant: the plan only holds calls that computed from the grid; a grid-derived value read on the host outside
those calls (``grid_thw.tolist()`` in the tower's own forward) or a call that cannot take its value precomputed
(no ``kwargs`` passed) is a refusal, a ``ValueError`` naming the place, never a value baked into a trace.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = [
    "CONFIG_INPUT", "MetadataCall", "MetadataPlan", "TowerRefused", "metadata_functions", "record_metadata",
    "wrapped_metadata_functions",
]


class TowerRefused(ValueError):
    """vgraph cannot serve this tower; the message names the reason (a ValueError, unlike the tower's own errors
    while it is probed, which may be any exception)."""

_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
}


CONFIG_INPUT = "<config>"
"""The name of the plan's input that is the tower's config (no argument can be named so)."""


@dataclass(frozen=True)
class _Input:
    """A tower argument (``grid_thw``), or the tower's config (``CONFIG_INPUT``), by name."""

    name: str

    def evaluate(self, inputs: dict[str, torch.Tensor], memo: dict) -> torch.Tensor:
        return inputs[self.name]


@dataclass(frozen=True, eq=False)
class _Op:
    """A torch function applied to recipes (and constants); ``leaf`` picks one tensor of a structured result."""

    func: Callable
    args: tuple
    kwargs: dict
    leaf: int | None = None

    def evaluate(self, inputs: dict[str, torch.Tensor], memo: dict) -> Any:
        key = (id(self.func), id(self.args))
        if key not in memo:
            args, kwargs = pytree.tree_map(lambda value: _evaluate(value, inputs, memo), (self.args, self.kwargs))
            memo[key] = self.func(*args, **kwargs)
        result = memo[key]
        return result if self.leaf is None else pytree.tree_leaves(result)[self.leaf]


def _evaluate(value: Any, inputs: dict, memo: dict) -> Any:
    return value.evaluate(inputs, memo) if isinstance(value, (_Input, _Op, _Output)) else value


@dataclass(frozen=True)
class MetadataCall:
    """One ``get_*`` call of the tower: ``function(**arguments)`` gives the values the tower pops as ``keys``."""

    function: Callable
    arguments: dict[str, Any]
    keys: tuple[str, ...]

    def values(self, inputs: dict[str, torch.Tensor], memo: dict) -> dict[str, Any]:
        if id(self) not in memo:
            arguments = {name: _evaluate(value, inputs, memo) for name, value in self.arguments.items()}
            result = self.function(**arguments)
            memo[id(self)] = dict(zip(self.keys, result if len(self.keys) > 1 else (result,)))
        return memo[id(self)]


@dataclass(frozen=True)
class _Output:
    """One value of an earlier call (``cu_window_seqlens`` passed on to ``get_max_seqlen``)."""

    call: MetadataCall
    key: str

    def evaluate(self, inputs: dict[str, torch.Tensor], memo: dict) -> Any:
        return self.call.values(inputs, memo)[self.key]


@dataclass(frozen=True)
class MetadataPlan:
    """The tower's grid-only metadata: ``compute(grid)`` gives every keyword its forward pops, by name."""

    grid_argument: str
    calls: tuple[MetadataCall, ...]
    config: Any = field(default=None, compare=False)
    """The config the calls read (``CONFIG_INPUT``): the served tower's own."""

    def bound(self, config: Any) -> "MetadataPlan":
        """This plan, reading ``config`` (None: unbound, as it is saved)."""
        return MetadataPlan(self.grid_argument, self.calls, config)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for call in self.calls for key in call.keys)

    def compute(self, grid_thw: torch.Tensor) -> dict[str, Any]:
        inputs, memo, values = {self.grid_argument: grid_thw, CONFIG_INPUT: self.config}, {}, {}
        for call in self.calls:
            values.update(call.values(inputs, memo))
        return values

    def describe(self) -> str:
        return "; ".join(f"{call.function.__name__} -> {', '.join(call.keys)}" for call in self.calls)


class _PopRecorder(dict):
    """The ``kwargs`` a wrapped function sees: remembers every key it pops, and whether the key was there."""

    def __init__(self, given: dict | None) -> None:
        super().__init__(given or {})
        self.popped: list[tuple[str, bool]] = []

    def pop(self, key, *default):
        self.popped.append((key, key in self))
        return super().pop(key, *default)


def _site() -> str:
    """The tower's own source line that made the current call (the innermost frame under transformers.models)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/transformers/models/" in frame.filename:
            return f"{frame.filename.rsplit('/transformers/', 1)[-1]}:{frame.lineno} ({frame.line})"
    return "an unknown place"


@dataclass
class _Recorder(TorchFunctionMode):
    """Follows grid-derived tensors through torch functions; records the wrapped calls and host reads."""

    recipes: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    calls: list[MetadataCall] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    depth: int = 0
    config: Any = None
    """The tower's config: recorded as the plan's ``CONFIG_INPUT`` wherever a call takes it."""

    def __post_init__(self) -> None:
        super().__init__()

    def tag(self, tensor: torch.Tensor, recipe: Any) -> None:
        self.recipes[id(tensor)] = (tensor, recipe)  # the tensor is held, so its id is not reused while recording

    def recipe(self, value: Any) -> Any:
        if value is self.config and value is not None:
            return _Input(CONFIG_INPUT)
        if isinstance(value, torch.Tensor) and id(value) in self.recipes:
            return self.recipes[id(value)][1]
        return value

    def derived(self, tree: Any) -> bool:
        return any(isinstance(leaf, torch.Tensor) and id(leaf) in self.recipes for leaf in pytree.tree_leaves(tree))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth or not self.derived((args, kwargs)):
            return func(*args, **kwargs)
        if func in _HOST_READS:
            self.refusals.append(f"reads a grid-derived tensor on the host ({func.__name__}) at {_site()}")
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        recipe_args, recipe_kwargs = pytree.tree_map(self.recipe, (args, kwargs))
        op = _Op(func, recipe_args, recipe_kwargs)
        for index, leaf in enumerate(pytree.tree_leaves(result)):
            if isinstance(leaf, torch.Tensor):
                self.tag(leaf, _Op(func, recipe_args, recipe_kwargs, index) if leaf is not result else op)
        return result

    def wrap(self, function: Callable) -> Callable:
        signature = inspect.signature(function)

        def recorded(*args, **kwargs):
            if self.depth:
                return function(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments.get("kwargs")
            pops = _PopRecorder(given)
            bound.arguments["kwargs"] = pops
            self.depth += 1
            try:
                result = function(*bound.args, **bound.kwargs)
            finally:
                self.depth -= 1
            arguments = {name: value for name, value in bound.arguments.items() if name != "kwargs"}
            keys = tuple(dict.fromkeys(key for key, present in pops.popped if not present))
            if not keys or not self.derived(arguments):
                return result  # a value passed through (an attention layer's max_seqlen), or nothing from the grid
            if given is None:
                self.refusals.append(
                    f"calls {function.__name__} without kwargs at {_site()}, so it cannot take its value precomputed"
                )
            elif len(keys) != (len(result) if isinstance(result, tuple) and len(keys) > 1 else 1):
                self.refusals.append(f"{function.__name__} pops {list(keys)} but returns {type(result).__name__}")
            else:
                recipe_arguments = {name: pytree.tree_map(self.recipe, value) for name, value in arguments.items()}
                call = MetadataCall(function, recipe_arguments, keys)
                self.calls.append(call)
                for key, value in zip(keys, result if len(keys) > 1 else (result,)):
                    if isinstance(value, torch.Tensor):
                        self.tag(value, _Output(call, key))
            return result

        recorded.__wrapped__ = function
        return recorded


def metadata_functions(module) -> dict[str, Callable]:
    """The module's functions that take a precomputed value from a ``kwargs`` dict parameter (not ``**kwargs``)."""
    found = {}
    for name, value in vars(module).items():
        if not (inspect.isfunction(value) and name.startswith("get_")):
            continue
        parameter = inspect.signature(value).parameters.get("kwargs")
        if parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            found[name] = value
    return found


@contextlib.contextmanager
def wrapped_metadata_functions(tower: torch.nn.Module, recorder: Any) -> Iterator[None]:
    """The tower's modeling modules' ``get_*`` functions replaced by ``recorder.wrap(function)`` inside the block,
    restored after it (also when it raises)."""
    modules = {sys.modules[type(module).__module__] for module in tower.modules()}
    patched = [(module, name, function) for module in modules for name, function in metadata_functions(module).items()]
    try:
        for module, name, function in patched:
            setattr(module, name, recorder.wrap(function))
        yield
    finally:
        for module, name, function in patched:
            setattr(module, name, function)


def record_metadata(
    tower: torch.nn.Module, pixel_values: torch.Tensor, grid_argument: str, grid_thw: torch.Tensor
) -> tuple[MetadataPlan, Any]:
    """(the tower's metadata plan, its output) from one eager forward on ``grid_thw``; ``ValueError`` when the tower
    uses the grid in a way the plan cannot serve."""
    recorder = _Recorder(config=getattr(tower, "config", None))
    recorder.tag(grid_thw, _Input(grid_argument))
    with wrapped_metadata_functions(tower, recorder), recorder:
        output = tower(pixel_values, **{grid_argument: grid_thw})
    name = type(tower).__name__
    if recorder.refusals:
        raise TowerRefused(f"{name} cannot be served by vgraph: it {'; it '.join(dict.fromkeys(recorder.refusals))}")
    if not recorder.calls:
        raise TowerRefused(f"{name} computes no grid metadata through transformers.vision_utils: not a packed tower")
    return MetadataPlan(grid_argument, tuple(recorder.calls), getattr(tower, "config", None)), output
