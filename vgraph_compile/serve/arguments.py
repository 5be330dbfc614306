"""Calling the runtime straight from the encoder's own arguments, without dynamo: the hot path.

Dynamo records where each graph input came from (a placeholder's ``grapharg.source``: ``L['patches']``,
``L['patches'].size()[0]``, ``L['self']._modules['blocks']...``). ``CallArguments`` turns those sources into
readers over the call's bound arguments: inputs rooted in an argument are read per call; everything else
(parameters, module state, globals) is bound once, to the value the trace saw.

Invariant: ``read`` gives the same graph inputs dynamo would pass, or None when the call differs from the
trace in a way only a retrace can tell: another structure (None where a tensor was), or another value of an
argument the trace specialized (a flag, a float, an int it did not make a size: one dynamo guarded by more than
its type; a value the trace never read, which dynamo does not guard, may change). Tensors' dtypes, devices and
static dims are the runtime's own per-call checks. ``OutputLayout`` rebuilds what the encoder returns (a tensor,
or tuples and lists of them) from the runtime's flat outputs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch
from torch._dynamo import source as dynamo_source

__all__ = [
    "AttributeStep", "CallArguments", "OutputLayout", "SizeStep", "argument_rooted", "pinned_sources", "source_name"
]

log = logging.getLogger(__name__)

Reader = Callable[[dict[str, Any]], Any]

_MATCHED_KEYS = 4096
"""At most this many call keys remembered as matching the trace (``CallArguments.read``; cleared past it)."""


def source_name(source) -> str:
    """A dynamo source as text (``L['x'].size()[0]``); a property in newer torch, a method in older."""
    name = source.name
    return name() if callable(name) else name


def argument_rooted(source) -> bool:
    """Whether ``source`` reads from one of the traced frame's arguments (``self`` excluded)."""
    return dynamo_source.get_local_source_name(source, only_allow_input=True) not in (None, "self")


class _Unsupported(Exception):
    """A source the hot path cannot read; the encoder keeps going through dynamo."""


class SizeStep(NamedTuple):
    """A path step: a tensor's size along ``dim``."""

    dim: int


class AttributeStep(NamedTuple):
    """A path step: an attribute of the value."""

    name: str


def _path(source, arguments: set[str]) -> tuple | None:
    """The steps from the call's bound arguments to the value of ``source``: the argument's name, then an item
    (an index or key), a ``SizeStep`` or an ``AttributeStep`` each; None for a source rooted elsewhere."""
    if isinstance(source, dynamo_source.LocalSource):
        return (source.local_name,) if source.local_name in arguments else None
    if isinstance(source, (dynamo_source.GetItemSource, dynamo_source.DictGetItemSource)):
        index = source.index
        if isinstance(index, dynamo_source.Source) or getattr(source, "index_is_slice", False):
            raise _Unsupported(f"an indexed argument ({type(index).__name__})")
        inner = _path(source.base, arguments)
        return None if inner is None else (*inner, index)
    if isinstance(source, dynamo_source.TensorPropertySource):
        inner = _path(source.base, arguments)
        if inner is None:
            return None
        if source.prop is not dynamo_source.TensorProperty.SIZE:
            raise _Unsupported(f"a tensor's {source.prop.name.lower()}")
        return (*inner, SizeStep(source.idx))
    if isinstance(source, dynamo_source.AttrSource):
        inner = _path(source.base, arguments)
        return None if inner is None else (*inner, AttributeStep(source.member))
    if isinstance(source, dynamo_source.ChainedSource):
        if _path(source.base, arguments) is None:
            return None
        raise _Unsupported(type(source).__name__)
    return None


def _step(inner: Reader, step: Any) -> Reader:
    if isinstance(step, SizeStep):
        return lambda local: inner(local).shape[step.dim]
    if isinstance(step, AttributeStep):
        return lambda local: getattr(inner(local), step.name)
    return lambda local: inner(local)[step]


def _reader(path: tuple) -> Reader:
    """A reader over the bound arguments that follows ``path`` (one closure per step, no loop per call)."""
    name = path[0]
    read: Reader = lambda local: local[name]
    for step in path[1:]:
        read = _step(read, step)
    return read


_TYPE_ONLY_GUARDS = frozenset({"TYPE_MATCH"})
"""Guards that pin a value's type, not the value."""


def pinned_sources() -> frozenset[str] | None:
    """The source names whose values the frame being traced specialized: those dynamo guards with more than their
    type (an int it read as a constant, a flag it branched on, an object it compared by identity). Read inside the
    backend's call, while dynamo's tracing context holds the guards; None outside one."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None:
        return None
    return frozenset(
        source_name(guard.originating_source)
        for guard in context.guards_context.dynamo_guards
        if guard.originating_source is not None and guard.create_fn_name() not in _TYPE_ONLY_GUARDS
    )


def _source_of(path: tuple) -> str:
    """Dynamo's name of the local source ``path`` reads (``L['kwargs']['max_seqlen']``)."""
    return f"L[{path[0]!r}]" + "".join(f"[{key!r}]" for key in path[1:])


@functools.lru_cache(maxsize=4096)
def _pinned(path: tuple, pinned: frozenset[str] | None) -> bool:
    """Whether the trace specialized the value at ``path`` or anything read from it (None: assume so); memoized,
    since the hot path asks it of every constant of every call it fingerprints."""
    if pinned is None:
        return True
    source = _source_of(path)
    return any(name == source or name.startswith((f"{source}.", f"{source}[")) for name in pinned)


def _fingerprint(value: Any, path: tuple, sizes: set[tuple], pinned: frozenset[str] | None) -> Any:
    """What of ``value`` the trace depends on beyond the graph inputs: structure, and the constants it specialized
    (any other value counts by its type: the trace never read it)."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_fingerprint(item, (*path, i), sizes, pinned) for i, item in enumerate(value))
    if isinstance(value, dict):
        return dict, tuple((key, _fingerprint(item, (*path, key), sizes, pinned)) for key, item in value.items())
    if path in sizes:
        if not isinstance(value, int) or isinstance(value, bool):
            where = path[0] + "".join(f"[{key!r}]" for key in path[1:])
            raise ValueError(f"{where} must be an int (it is a size of the encoder's trace), got {value!r}")
        return int
    return (type(value), value) if _pinned(path, pinned) else type(value)


@dataclass
class CallArguments:
    """Reads every graph input of one trace from an encoder call's arguments."""

    signature: inspect.Signature
    paths: list[tuple | None]
    """Per graph input: the path it is read from per call (``_path``), or None when it is bound."""
    bound: list[Any]
    """Per graph input: its value fixed at trace time (where ``paths`` is None)."""
    positional: tuple[str, ...] = ()
    """The parameter names before a ``**kwargs`` (all of them where there is none), when a call giving all of them
    positionally needs no ``Signature.bind``."""
    var_keyword: str | None = None
    """The name of the ``**kwargs`` parameter that follows ``positional`` (None: there is none)."""
    pinned: frozenset[str] | None = None
    """Source names of the values the trace specialized (``pinned_sources``); None: every constant."""
    fingerprint: Any = None

    def __post_init__(self) -> None:
        self.sizes = {path for path in self.paths if path is not None}
        """Paths of the graph inputs read per call: an int there is a size, so its value may change."""
        self._read = [(index, _reader(path)) for index, path in enumerate(self.paths) if path is not None]
        """The inputs read per call (a few), apart from the bound ones (every parameter)."""
        self._matched: set[Hashable] = set()
        """Call keys whose call matched the fingerprint (``read``)."""

    @classmethod
    def over(
        cls,
        forward: Callable[..., Any],
        paths: list[tuple | None],
        bound: list[Any],
        pinned: frozenset[str] | None = None,
    ) -> "CallArguments":
        """Readers of ``paths`` over the arguments of ``forward``'s calls, the other inputs bound."""
        signature = inspect.signature(forward)
        parameters = list(signature.parameters.values())
        var_keyword = None
        if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = parameters.pop().name
        plain = all(
            parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for parameter in parameters
        )
        names = tuple(parameter.name for parameter in parameters) if plain else ()
        return cls(signature, list(paths), list(bound), names, var_keyword if plain else None, pinned)

    @classmethod
    def from_trace(
        cls,
        sources: Sequence[Any],
        fixed: Sequence[Any],
        forward: Callable[..., Any],
        pinned: frozenset[str] | None = None,
    ) -> "CallArguments | None":
        """Readers for the graph inputs of ``sources`` (dynamo's, one per input; ``fixed`` holds the traced value
        of each input not rooted in an argument; ``pinned``: the sources the trace specialized). None (logged)
        when the hot path cannot read some input."""
        names = set(inspect.signature(forward).parameters)
        paths = []
        for index, source in enumerate(sources):
            try:
                if source is None:
                    raise _Unsupported(f"graph input {index} has no source")
                path = _path(source, names)
                if path is None and fixed[index] is None:
                    raise _Unsupported(
                        f"graph input {index} ({source_name(source)}) that is neither an argument nor state"
                    )
            except _Unsupported as why:
                log.info("the encoder keeps dynamo's guards on every call: its inputs include %s", why)
                return None
            paths.append(path)
        return cls.over(forward, paths, fixed, pinned)

    def _local(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if self.positional and len(args) == len(self.positional):
            if not kwargs and self.var_keyword is None:
                return dict(zip(self.positional, args))
            if self.var_keyword is not None and not any(name in kwargs for name in self.positional):
                local = dict(zip(self.positional, args))
                local[self.var_keyword] = kwargs
                return local
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def _fingerprints(self, local: dict[str, Any]) -> dict[str, Any]:
        return {name: _fingerprint(value, (name,), self.sizes, self.pinned) for name, value in local.items()}

    def remember(self, args: tuple, kwargs: dict) -> None:
        """Record the traced call's fingerprint (structure and specialized constants)."""
        local = self._local(args, kwargs)
        self.fingerprint = self._fingerprints(local)

    def read(self, args: tuple, kwargs: dict, key: Hashable = None) -> list[Any] | None:
        """The graph inputs for this call, or None when it needs a retrace; a ValueError for a size that is no int.

        A ``key`` promises that every argument but the token rows equals that of earlier calls with the key
        (``CompiledEncoderFunction.call_keyed``): once one of them matched the trace's fingerprint, the others are
        not fingerprinted again."""
        try:
            local = self._local(args, kwargs)
        except TypeError:
            return None
        if key is None or key not in self._matched:
            if self._fingerprints(local) != self.fingerprint:
                return None
            if key is not None:
                if len(self._matched) >= _MATCHED_KEYS:
                    self._matched.clear()
                self._matched.add(key)
        inputs = self.bound.copy()
        for index, read in self._read:
            inputs[index] = read(local)
        return inputs


@dataclass(frozen=True)
class OutputLayout:
    """Where each returned tensor sits among the runtime's outputs: an index, or a list/tuple of layouts."""

    layout: Any

    @classmethod
    def match(cls, result: Any, outputs: Sequence[Any]) -> "OutputLayout | None":
        """The layout of ``result`` over ``outputs`` (by identity); None when something else is returned."""
        try:
            return cls(_find(result, outputs))
        except _Unsupported as why:
            log.info("the encoder keeps dynamo on every call: it returns %s", why)
            return None

    def build(self, outputs: Sequence[Any]) -> Any:
        """The returned structure over ``outputs``. ``_find`` and ``_build`` are module functions, not closures: a
        nested function that calls itself is a reference cycle, which would keep every call's outputs alive until
        the cyclic garbage collector runs (gigabytes of device memory between collections)."""
        return _build(self.layout, outputs)


def _find(value: Any, outputs: Sequence[Any]) -> Any:
    if isinstance(value, torch.Tensor):
        for index, output in enumerate(outputs):
            if output is value:
                return index
        raise _Unsupported("a tensor that is not a graph output")
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value), tuple(_find(item, outputs) for item in value)
    if value is None:
        return None
    raise _Unsupported(f"a {type(value).__name__}")


def _build(layout: Any, outputs: Sequence[Any]) -> Any:
    if layout is None:
        return None
    if isinstance(layout, int):
        return outputs[layout]
    kind, items = layout
    return kind(_build(item, outputs) for item in items)
