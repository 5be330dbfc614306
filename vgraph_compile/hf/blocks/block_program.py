"""The block program of a vision tower: which module list holds its transformer blocks, and where each block
call's arguments come from, learned from one eager forward of the stock tower.

``record_block_program(tower, args, kwargs)`` calls the tower once with hooks on the entries of every module list
and a ``TorchFunctionMode`` that watches the glue (the tower's code outside the blocks). The block stack is the
module list (the one holding the most parameters) whose entries were each called once, in order, every call after
the first taking the previous one's output. Each leaf of a block call's arguments is then

- ``threaded``: the hidden states, the previous block's output (a segment's first block's: the segment's input);
- an ``input`` of its segment: a tensor the glue made before the segment ran (``cu_seqlens``, the position
  embeddings; one input per tensor, however many blocks take it), or an int (``max_seqlen``; one input per value);
- a ``constant``: anything else (None, a flag, a float), the same on every call.

A block whose own code computes a value on the host from its arguments through a transformers ``get_*`` function
that takes it precomputed (``get_max_seqlen``'s ``.item()`` in an attention that gets no ``max_seqlen``) is given that
value as a keyword: the program computes it on the host before the graph runs (``HostValue``), so the graph holds
no host read.

The calls are cut into segments after each block whose output the glue reads (a merger between blocks): each
segment is one graph, taking the hidden states the glue gives its first block.

Invariant: a segment's blocks see nothing but its hidden states, the glue's tensors made before it ran, and ints:
no block reads another's output but the previous one's, the glue reads no block's output but a segment's last,
and a block that reads a host list it takes (the grid as Python ints: LFM3-VL's convolution blocks loop over the
items) is a segment of its own, run as written (a ``_WatchedList`` notes the reads while the call is recorded).
Otherwise ``BlocksRefused`` names what broke.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from vgraph_compile.hf.interface.metadata_plan import wrapped_metadata_functions

__all__ = [
    "BlockCall",
    "BlockProgram",
    "BlocksRefused",
    "HostValue",
    "Leaf",
    "Recorded",
    "Segment",
    "flatten_arguments",
    "record_block_program",
]


class BlocksRefused(ValueError):
    """Not even the tower's blocks can be served from graphs; the message names the reason."""


@dataclass(frozen=True)
class Leaf:
    """Where one leaf of a block call's flattened ``(args, kwargs)`` comes from."""

    source: Literal["threaded", "input", "constant", "unread"]
    index: int = 0
    """``input``: the segment input's position."""
    value: Any = None
    """``constant``: the value every call passes; ``unread``: a host list the block takes but never reads (LFM3-VL's
    attention blocks get the grid list their convolution blocks loop over), passed on as recorded."""


@dataclass(frozen=True)
class HostValue:
    """A value a block computes on the host from its own arguments, through a transformers function that takes it
    precomputed from a ``kwargs`` dict under ``key`` (``get_max_seqlen``: ``max_seqlen`` from ``cu_seqlens`` with
    ``.item()``, in an attention the glue passes no ``max_seqlen``). The program computes it before the graph runs
    and passes it to the block as the keyword ``key``, which the block hands on to that function."""

    key: str
    function: Callable
    arguments: dict[str, Any]
    """The function's arguments: for a name in ``tensor_leaves``, the position of that tensor among the block
    call's flattened arguments; otherwise the constant the recorded call passed."""
    tensor_leaves: tuple[str, ...]
    """The arguments that are tensors the block takes."""

    def compute(self, leaves: list) -> Any:
        """The value for a call whose flattened arguments are ``leaves`` (attention routed, as when recorded)."""
        arguments = {
            name: leaves[value] if name in self.tensor_leaves else value for name, value in self.arguments.items()
        }
        return self.function(**arguments, kwargs={})


@dataclass(frozen=True)
class BlockCall:
    """One block's call: the structure of its ``(args, kwargs)`` (the host values' keywords included) and the
    source of each leaf."""

    spec: pytree.TreeSpec
    leaves: tuple[Leaf, ...]
    host_values: tuple[HostValue, ...] = ()


@dataclass(frozen=True)
class Segment:
    """A run of blocks the glue calls back to back, reading none of their outputs but the last: one graph."""

    first: int
    """The index of its first block in the module list."""
    calls: tuple[BlockCall, ...]
    inputs: int
    """How many inputs its calls read besides the threaded hidden states (tensors and ints, in first-use order)."""
    read_at: str | None = None
    """Where the glue reads its last block's output (None: the stack's last segment)."""
    host_list: str | None = None
    """A block that reads a host list it takes (the grid as Python ints: its own code loops over the items) is a
    segment of its own, run as written; this names the argument. None: a segment served by one graph."""

    @property
    def stop(self) -> int:
        return self.first + max(len(self.calls), 1)


@dataclass(frozen=True)
class BlockProgram:
    """The tower's block stack: its blocks' calls, in order, cut into segments where the glue reads a block's
    output (MiniCPM-V's merger after block 6: two segments)."""

    path: str
    """The module list's name in the tower (``encoder.layers``)."""
    segments: tuple[Segment, ...]
    output_spec: pytree.TreeSpec
    """The structure of a block's output (each block's is the same)."""
    output_leaf: int
    """The leaf of a block's output that the next block takes (the hidden states)."""

    @property
    def blocks(self) -> int:
        return self.segments[-1].stop

    def segment_of(self, index: int) -> Segment:
        return next(segment for segment in self.segments if index < segment.stop)

    def describe(self) -> str:
        graphs = sum(segment.host_list is None for segment in self.segments)
        notes = [f"block {s.stop - 1}'s output read at {s.read_at}" for s in self.segments if s.read_at]
        eager = [s for s in self.segments if s.host_list is not None]
        if eager:
            blocks = [segment.first for segment in eager]
            notes.append(f"blocks {blocks} run as written: they read a host list ({eager[0].host_list})")
        host = {f"{value.key} ({value.function.__name__})" for s in self.segments for call in s.calls
                for value in call.host_values}  # fmt: skip
        if host:
            notes.append(f"computed on the host before the graph: {', '.join(sorted(host))}")
        graphs = f"{graphs} graph{'s' * (graphs != 1)} ({'; '.join(notes)})" if notes else "one graph"
        return f"{self.blocks} blocks of {self.path}, {graphs}"


_SHAPE_READS = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.is_floating_point,
}
"""Reads of a block output that do not read its values."""


def _place() -> str:
    """The innermost line of transformers' model code on the stack (the glue's line)."""
    frames = [frame for frame in traceback.extract_stack() if "/transformers/models/" in frame.filename]
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/transformers/', 1)[-1]}:{frame.lineno} ({frame.line})"


@dataclass
class _Event:
    """One call of a module list's entry: its index, its arguments, its output."""

    index: int
    args: tuple
    kwargs: dict
    output: Any = None
    reads_host_list: bool = False
    host_calls: list = field(default_factory=list)
    """(function, its arguments, the key it computed, the value) of each host value computed inside the block."""
    host_values: tuple[HostValue, ...] = ()


class _Recorder(TorchFunctionMode):
    """Records the calls of every module list's entries, and the first glue read of a block output."""

    def __init__(self, lists: dict[str, torch.nn.ModuleList]) -> None:
        super().__init__()
        self.events: dict[str, list[_Event]] = {path: [] for path in lists}
        self.depth = 0
        self.outputs: dict[int, tuple[str, int]] = {}
        """id of a tensor an entry returned -> (list, call number)."""
        self.kept: list[Any] = []
        """The outputs themselves, so their ids stay theirs while the tower runs."""
        self.glue_reads: dict[tuple[str, int], str] = {}
        """(list, call number) -> where the glue first read that call's output."""
        self.list_reads: set[tuple[str, int]] = set()
        """(list, call number) of the calls that read a host list they took."""
        self.active: list[_Event] = []
        """The entries' calls running now, innermost last."""
        self.handles = []
        for path, modules in lists.items():
            for index, module in enumerate(modules):
                self.handles.append(module.register_forward_pre_hook(self._before(path, index), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._after(path)))

    def _before(self, path: str, index: int):
        def hook(module, args, kwargs):
            self.depth += 1
            key = (path, len(self.events[path]))
            args = tuple(_WatchedList(v, self.list_reads, key) if _is_host_list(v) else v for v in args)
            kwargs = {k: _WatchedList(v, self.list_reads, key) if _is_host_list(v) else v for k, v in kwargs.items()}
            self.events[path].append(_Event(index, args, dict(kwargs)))
            self.active.append(self.events[path][-1])
            return args, kwargs

        return hook

    def _after(self, path: str):
        def hook(module, args, output):
            self.depth -= 1
            self.active.pop()
            event = self.events[path][-1]
            event.output = output
            self.kept.append(output)
            for leaf in pytree.tree_leaves(output):
                if isinstance(leaf, torch.Tensor):
                    self.outputs[id(leaf)] = (path, len(self.events[path]) - 1)

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0 and func not in _SHAPE_READS:
            for leaf in pytree.tree_leaves((args, kwargs)):
                key = self.outputs.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if key is not None and key not in self.glue_reads:
                    self.glue_reads[key] = _place()
        return func(*args, **kwargs)

    def wrap(self, function: Callable) -> Callable:
        """``function`` (it takes precomputed values from a ``kwargs`` dict) noting, inside an entry's call, each
        value it computes on the host because the dict had none."""
        signature = inspect.signature(function)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments.get("kwargs")
            pops = _Pops(given or {})
            bound.arguments["kwargs"] = pops
            result = function(*bound.args, **bound.kwargs)
            computed = [key for key, present in pops.popped if not present]
            if self.active and given is not None and len(computed) == 1 and type(result) is int:
                arguments = {name: value for name, value in bound.arguments.items() if name != "kwargs"}
                self.active[-1].host_calls.append((function, arguments, computed[0], result))
            return result

        recorded.__wrapped__ = function
        return recorded

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Pops(dict):
    """The ``kwargs`` dict a wrapped function sees: notes each key it pops, and whether a value (not None) was
    there."""

    def __init__(self, given: dict) -> None:
        super().__init__(given)
        self.popped: list[tuple[str, bool]] = []

    def pop(self, key, *default):
        self.popped.append((key, self.get(key) is not None))
        return super().pop(key, *default)


def _host_values(path: str, event: _Event) -> tuple[HostValue, ...]:
    """The event's host calls as ``HostValue``s over its arguments' leaves; each value is added to the event's
    keywords, as the program passes it; ``BlocksRefused`` when one reads a tensor the block does not take."""
    if not event.host_calls:
        return ()
    leaves = flatten_arguments(event.args, event.kwargs)[0]
    positions = {id(leaf): position for position, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    values = []
    for function, arguments, key, result in event.host_calls:
        tensors = {name for name, value in arguments.items() if isinstance(value, torch.Tensor)}
        if any(id(arguments[name]) not in positions for name in tensors):
            raise BlocksRefused(
                f"block {event.index} of {path} computes {key} on the host ({function.__name__}) from a tensor "
                "it does not take"
            )
        resolved = {name: positions[id(value)] if name in tensors else value for name, value in arguments.items()}
        values.append(HostValue(key, function, resolved, tuple(sorted(tensors))))
        event.kwargs[key] = result
    return tuple(values)


def _module_lists(tower: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    return {
        path: module
        for path, module in tower.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module)
    }


def _in_sequence(events: list[_Event], size: int) -> bool:
    return [event.index for event in events] == list(range(size))


def _threaded_leaf(runs: list[list[_Event]]) -> tuple[int, int]:
    """(the argument leaf that takes the previous block's output, the output leaf it is), the same for every block
    of every run; runs of one block each: the first tensor argument and first tensor output."""
    def tensor_positions(leaves: list) -> list[int]:
        return [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    found = set()
    for events in runs:
        for before, event in zip(events, events[1:]):
            outputs = {id(leaf): position for position, leaf in enumerate(pytree.tree_leaves(before.output))}
            pairs = [
                (position, outputs[id(leaf)])
                for position, leaf in enumerate(flatten_arguments(event.args, event.kwargs)[0])
                if isinstance(leaf, torch.Tensor) and id(leaf) in outputs
            ]
            if len(pairs) != 1:
                raise BlocksRefused(f"block {event.index} does not take the output of block {before.index} as it is")
            found.add(pairs[0])
    if len(found) > 1:
        raise BlocksRefused("its blocks take the previous block's output in different arguments")
    if found:
        return found.pop()
    event = runs[0][0]
    inputs = tensor_positions(flatten_arguments(event.args, event.kwargs)[0])
    outputs = tensor_positions(pytree.tree_leaves(event.output))
    if not inputs or not outputs:
        raise BlocksRefused("its block takes or returns no tensor")
    return inputs[0], outputs[0]


def _is_host_list(value: Any) -> bool:
    """A list or tuple of ints (nested), as ``grid_thw.tolist()`` gives: one leaf of a block call's arguments."""
    if not isinstance(value, (list, tuple)):
        return False
    leaves = pytree.tree_leaves(list(value))
    return bool(leaves) and all(type(leaf) is int for leaf in leaves)


def flatten_arguments(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    """A block call's ``(args, kwargs)`` flattened, each host list one leaf (its length changes with the items)."""
    return pytree.tree_flatten((args, kwargs), is_leaf=_is_host_list)


class _WatchedList(list):
    """A host list handed to a block while it is recorded: notes whether the block reads it."""

    def __init__(self, values, reads: set, key) -> None:
        super().__init__(values)
        self._reads, self._key = reads, key

    def _read(self) -> None:
        self._reads.add(self._key)

    def __iter__(self):
        self._read()
        return super().__iter__()

    def __getitem__(self, index):
        self._read()
        return super().__getitem__(index)

    def __len__(self):
        self._read()
        return super().__len__()


def _host_list(tree) -> str | None:
    """The keyword (or argument position) of a list or tuple of ints among a call's arguments, if any."""
    args, kwargs = tree
    for name, value in [*enumerate(args), *kwargs.items()]:
        if _is_host_list(value):
            return str(name)
    return None


def _runs(events: list[_Event], path: str, glue_reads: dict) -> list[list[_Event]]:
    """The calls cut after every block whose output the glue reads (the last block's aside), and around every
    block that reads a host list it takes."""
    cuts = {number + 1 for (list_path, number) in glue_reads if list_path == path and number < len(events) - 1}
    for event in events:
        if event.reads_host_list:
            cuts |= {event.index, event.index + 1}
    bounds = sorted({0, *cuts, len(events)})
    return [events[start:stop] for start, stop in zip(bounds, bounds[1:])]


def _segment(path: str, events: list[_Event], in_position: int, outputs: dict, glue_reads: dict) -> Segment:
    """One run's calls, each leaf with its source; ``BlocksRefused`` where a block takes a host list or another
    block's output than the previous one's."""
    inputs: dict[tuple[str, Any], int] = {}
    """("tensor", id) or ("int", block, leaf position) -> the input's position, in first-use order: a tensor passed to
    several blocks is one input; every int is its own (two ints equal on the recorded call may differ later)."""
    calls = []
    if events[0].reads_host_list:  # a block of its own (``_runs``), run as written
        host_list = _host_list((events[0].args, events[0].kwargs))
        return Segment(events[0].index, (), 0, glue_reads.get((path, events[0].index)), host_list)
    for event in events:
        leaves, spec = flatten_arguments(event.args, event.kwargs)
        sources = []
        for position, leaf in enumerate(leaves):
            if position == in_position:
                sources.append(Leaf("threaded"))
            elif isinstance(leaf, torch.Tensor):
                producer = outputs.get(id(leaf))
                if producer is not None and producer[0] == path:
                    raise BlocksRefused(f"block {event.index} of {path} reads the output of block {producer[1]}")
                sources.append(Leaf("input", inputs.setdefault(("tensor", id(leaf)), len(inputs))))
            elif type(leaf) is int:
                sources.append(Leaf("input", inputs.setdefault(("int", event.index, position), len(inputs))))
            elif _is_host_list(leaf):
                sources.append(Leaf("unread", value=list(leaf)))
            else:
                sources.append(Leaf("constant", value=leaf))
        calls.append(BlockCall(spec, tuple(sources), event.host_values))
    return Segment(events[0].index, tuple(calls), len(inputs), glue_reads.get((path, events[-1].index)))


def _program(path: str, events: list[_Event], glue_reads: dict, outputs: dict) -> BlockProgram:
    """The program of the block stack ``path``, or ``BlocksRefused`` naming what breaks its invariant."""
    runs = _runs(events, path, glue_reads)
    in_position, out_position = _threaded_leaf([run for run in runs if not run[0].reads_host_list] or runs)
    output_spec = pytree.tree_flatten(events[-1].output)[1]
    leaves = pytree.tree_leaves(events[-1].output)
    extra = [leaf for position, leaf in enumerate(leaves) if position != out_position and leaf is not None]
    if extra:
        raise BlocksRefused(f"its blocks return more than the hidden states ({type(extra[0]).__name__})")
    segments = tuple(_segment(path, run, in_position, outputs, glue_reads) for run in runs[:-1])
    segments += (_segment(path, runs[-1], in_position, outputs, {}),)
    if all(segment.host_list is not None for segment in segments):
        raise BlocksRefused(
            f"every block of {path} reads a host list ({segments[0].host_list}): its own code loops over the grid, "
            "so its shapes change with the items"
        )
    return BlockProgram(path, segments, output_spec, out_position)


@contextlib.contextmanager
def _recording(tower: torch.nn.Module) -> Iterator[_Recorder]:
    recorder = _Recorder(_module_lists(tower))
    try:
        with recorder:
            yield recorder
    finally:
        recorder.close()


@dataclass(frozen=True)
class Recorded:
    """What one eager forward showed: the program, the stock output, and per segment the hidden states it took and
    its inputs in that call."""

    program: BlockProgram
    output: Any
    segment_inputs: tuple[tuple[torch.Tensor, tuple], ...]


def _inputs_of(segment: Segment, events: list[_Event]) -> tuple[torch.Tensor, tuple]:
    """(the segment's hidden states, its inputs) as the recorded calls passed them."""
    inputs: list[Any] = [None] * segment.inputs
    hidden = None
    for call, event in zip(segment.calls, events[segment.first : segment.stop]):
        for source, leaf in zip(call.leaves, flatten_arguments(event.args, event.kwargs)[0]):
            if source.source == "input":
                inputs[source.index] = leaf
            elif source.source == "threaded" and hidden is None:
                hidden = leaf
    return hidden, tuple(inputs)


def record_block_program(tower: torch.nn.Module, args: tuple, kwargs: dict) -> Recorded:
    """The tower's block program, learned from the call ``tower(*args, **kwargs)`` (see the module docstring);
    ``BlocksRefused`` naming the reason when no module list of the tower is a block stack a program can hold."""
    lists = _module_lists(tower)
    with _recording(tower) as recorder, wrapped_metadata_functions(tower, recorder):
        output = tower(*args, **kwargs)
    candidates = [path for path, events in recorder.events.items() if _in_sequence(events, len(lists[path]))]
    if not candidates:
        raise BlocksRefused("no module list of its blocks was called in sequence, each block once")
    path = max(candidates, key=lambda name: sum(p.numel() for p in lists[name].parameters()))
    events = recorder.events[path]
    for number, event in enumerate(events):
        event.reads_host_list = (path, number) in recorder.list_reads
        event.host_values = _host_values(path, event)
    program = _program(path, events, recorder.glue_reads, recorder.outputs)
    return Recorded(program, output, tuple(_inputs_of(segment, events) for segment in program.segments))
