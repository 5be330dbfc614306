"""Tier 2, block graphs: a vision tower whose forward cannot be one graph (it reads the grid on the host:
``grid_thw.tolist()`` loops, ``.item()``, per-item splits) is served with its glue run as written and its whole
stack of transformer blocks replayed from vgraph bucket graphs, one replay per call (one per segment where the glue
reads the output of a block between others: MiniCPM-V's merger after block 6 makes two). A block whose own code
loops over the grid (it takes the grid as a host list: LFM3-VL's convolution blocks) runs as written between the
graphs.

How (the "block program" design; ``hf/blocks/block_program``):
1. The first call runs the stock tower once, eagerly, with its attention routed through vgraph's op, and records
   the block program: the module list of blocks, and where each block call's arguments come from. Its output is
   the stock output.
2. ``BlockStack`` (the blocks in sequence, each call's arguments rebuilt from the program's inputs) is compiled
   with ``vgraph_compile.encoder``: the same backend, analyses, bounds, padding, runtimes and buckets as any
   encoder, traced once on the recorded inputs (the hidden states, ``cu_seqlens``, position embeddings,
   ``max_seqlen``), with symbolic sizes: no grid value is in the trace or its guards.
3. Every later call runs the tower's forward on a shallow copy of the tower (its own tensors, not copies) whose
   block list holds proxies and whose config routes attention through vgraph's op. Each proxy checks its call
   against the program and hands back the threaded hidden states; the last one replays the stack's graph with the
   inputs the glue gave, and returns the stack's output. A call whose glue takes another path than the recorded
   one (``_OffProgram``) is run by the stock tower, counted (``counters.eager_fallbacks``) and logged once.

Where the blocks cannot be graphs either (every block reads a host list; they do not attend over packed rows; the
stack does not trace as one graph), ``blocks_refused`` gets both tiers' reasons, and the module it returns (the
exact-size code, ``hf/exact_size/exact_size_tower``) serves from that first call on; without one, ``BlocksRefused`` is raised.

Invariant: the blocks run only inside the graph, and the glue reads no block output but the last
(``record_block_program`` proves it on the recorded call, and every proxy checks its arguments' sources). Padding
and isolation are the encoder's: padded rows form their own segments, so a NaN image stays in its rows.
Concurrent callers each have their own per-call state (thread-local) and the runtime is thread-safe.
"""

from __future__ import annotations

import copy
import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.entry.decorator import CompiledEncoderFunction
from vgraph_compile.hf.attention import routed_attention, routed_config
from vgraph_compile.hf.blocks.block_program import (
    BlockProgram,
    BlocksRefused,
    Recorded,
    Segment,
    flatten_arguments,
    record_block_program,
)
from vgraph_compile.hf.stand_in import TowerStandIn, first_line
from vgraph_compile.hf.whole_graph.tower_call import own_code

__all__ = ["BlockStack", "CompiledBlockTower", "compile_block_tower"]

log = logging.getLogger(__name__)


def _squeezed(value: Any) -> bool:
    """Whether a tensor input is passed to the stack without its leading dim of 1 (``[1, rows, width]``): the
    stack's packed dim is dim 0."""
    return isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[0] == 1


class BlockStack(torch.nn.Module):
    """The traced forward of one segment: its blocks (the tower's own modules) in sequence, each call's arguments
    rebuilt from the segment's inputs. ``squeezed`` (per input, the hidden states first) says which inputs come
    without their leading dim of 1; the output comes back the same way as the hidden states."""

    def __init__(self, blocks: torch.nn.ModuleList, segment: Segment, output_leaf: int, squeezed: tuple[bool, ...]):
        super().__init__()
        self.blocks = blocks
        self.segment = segment
        self.output_leaf = output_leaf
        self.squeezed = squeezed
        self.forward = types.MethodType(own_code(type(self).forward), self)  # each stack its own trace cache

    def forward(self, hidden: torch.Tensor, *inputs: Any) -> torch.Tensor:
        hidden, *inputs = (value.unsqueeze(0) if squeeze else value for value, squeeze in
                           zip((hidden, *inputs), self.squeezed))  # fmt: skip
        for block, call in zip(self.blocks, self.segment.calls):
            leaves = [
                hidden if leaf.source == "threaded" else inputs[leaf.index] if leaf.source == "input" else leaf.value
                for leaf in call.leaves
            ]
            args, kwargs = pytree.tree_unflatten(leaves, call.spec)
            hidden = pytree.tree_leaves(block(*args, **kwargs))[self.output_leaf]
        return hidden[0] if self.squeezed[0] else hidden


class _OffProgram(Exception):
    """The glue called a block otherwise than the program says (another path through the tower's code)."""


@dataclass
class _StackCall:
    """One call's progress through the program: the next block, and the open segment's hidden states and inputs."""

    program: BlockProgram
    next_block: int = 0
    hidden: torch.Tensor | None = None
    inputs: list[Any] = field(default_factory=list)
    host_memo: dict = field(default_factory=dict)
    """The host values computed in this call, by function, key and the ids of their tensors."""

    def take(self, index: int, args: tuple, kwargs: dict) -> Segment:
        """Read block ``index``'s arguments into the open segment's inputs and return the segment; ``_OffProgram``
        where they break the program."""
        if index != self.next_block or index >= self.program.blocks:
            raise _OffProgram(f"block {index} was called out of order")
        segment = self.program.segment_of(index)
        if segment.host_list is not None:  # run as written: its arguments change structure with the items
            self.next_block += 1
            return segment
        call = segment.calls[index - segment.first]
        leaves, spec = flatten_arguments(args, kwargs)
        if spec != call.spec:
            raise _OffProgram(f"block {index} was called with another argument structure")
        if index == segment.first:
            self.inputs = [_UNSET] * segment.inputs
        for leaf, source in zip(leaves, call.leaves):
            if source.source == "threaded":
                if index == segment.first:
                    self.hidden = leaf
                elif leaf is not self.hidden:
                    raise _OffProgram(f"block {index} does not take block {index - 1}'s output")
            elif source.source == "input":
                seen = self.inputs[source.index]
                if seen is _UNSET:
                    self.inputs[source.index] = leaf
                elif seen is not leaf and (isinstance(leaf, torch.Tensor) or seen != leaf):
                    raise _OffProgram(f"block {index} takes another value where an earlier block took the same one")
            elif source.source == "constant" and leaf != source.value:
                raise _OffProgram(f"block {index} takes {leaf!r} where the program has {source.value!r}")
        self.next_block += 1
        return segment


_UNSET = object()


class _BlockProxy(torch.nn.Module):
    """Stands in a block of the served copy: hands its call to the owner (``CompiledBlockTower._block``)."""

    def __init__(self, owner: "CompiledBlockTower", index: int) -> None:
        super().__init__()
        self.__dict__["owner"] = owner  # not a submodule: the owner holds this proxy
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner._block(self.index, args, kwargs)


def _served_copy(tower: torch.nn.Module, path: str, proxies: torch.nn.ModuleList) -> torch.nn.Module:
    """A shallow copy of ``tower`` (its own parameters and submodules) whose module list ``path`` is ``proxies``,
    and whose modules on the way there (the glue that calls the blocks) read a config that routes attention through
    vgraph's op, so the glue passes the blocks what the trace took (``max_seqlen``); the tower is unchanged."""
    routed = routed_config(tower.config)
    served = copy.copy(tower)
    owner, names = served, path.split(".")
    for name in names:
        if getattr(owner, "config", None) is tower.config:
            owner.__dict__["config"] = routed
        owner._modules = dict(owner._modules)
        if name == names[-1]:
            owner._modules[name] = proxies
        else:
            owner._modules[name] = owner = copy.copy(owner._modules[name])
    return served


class CompiledBlockTower(TowerStandIn):
    """A tower served by block graphs (see the module docstring): call it as the tower. ``tier_reason`` says why
    the whole forward is not one graph. Calls with grad enabled or in training mode run the stock tower."""

    tier = "block graphs"

    def __init__(
        self,
        tower: torch.nn.Module,
        config: VGraphConfig,
        tier_reason: str,
        blocks_refused: Callable[[str], torch.nn.Module] | None = None,
    ) -> None:
        super().__init__(tower)
        self.vgraph_config = config
        self.tier_reason = tier_reason
        """Why the whole-tower graph does not serve this tower (the host op, with its file and line)."""
        self.blocks_refused = blocks_refused
        """What serves the tower when its blocks cannot be graphs either (called with both tiers' reasons): the
        exact-size code, from ``compile_vision_tower``; None: the refusal is raised."""
        self.stock_calls = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._reset()

    def _reset(self) -> None:
        """Record the program again at the next call (the tower's tensors changed)."""
        self.__dict__["program"] = None
        self.__dict__["compiled"] = None
        """Per segment of the program, its compiled ``BlockStack``."""
        self.__dict__["served"] = None
        self.__dict__["_warned_off_program"] = False

    def _runtimes(self) -> list:
        """One per segment's trace; normally one."""
        return [runtime for compiled in self.compiled or () if compiled for runtime in compiled.vgraph.runtimes]

    def _stats_table(self) -> str:
        program = self.program.describe() if self.program is not None else "not recorded yet"
        lines = [f"tier: block graphs ({program}); the whole forward is not one graph: {self.tier_reason}"]
        lines += [runtime.stats_table() for runtime in self.runtimes]
        return "\n".join(lines)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training or torch.is_grad_enabled():
            self.stock_calls += 1
            return self.tower(*args, **kwargs)
        if self.program is None:
            with self._lock:
                if self.program is None and self.replacement is None:
                    return self._record(args, kwargs)
        if self.replacement is not None:
            return self.replacement(*args, **kwargs)
        self._local.call = _StackCall(self.program)
        try:
            output = self.served(*args, **kwargs)
            if self._local.call.next_block != self.program.blocks:
                raise _OffProgram(f"the glue called {self._local.call.next_block} of {self.program.blocks} blocks")
        except _OffProgram as reason:
            return self._stock(reason, args, kwargs)
        finally:
            self._local.call = None
        return output

    def _stock(self, reason: _OffProgram, args: tuple, kwargs: dict) -> Any:
        counters.eager_fallbacks += 1
        if not self._warned_off_program:
            self.__dict__["_warned_off_program"] = True
            log.warning("%s: %s; the stock tower serves such calls", type(self.tower).__name__, reason)
        with routed_attention(self.tower):
            return self.tower(*args, **kwargs)

    def _record(self, args: tuple, kwargs: dict) -> Any:
        """The first call: record the program and compile it (``_program``); returns the stock output. Where the
        blocks are refused, ``blocks_refused``'s module serves this call and every later one."""
        try:
            return self._program(args, kwargs)
        except BlocksRefused as refusal:
            if self.blocks_refused is None:
                raise
            self.hand_down(self.blocks_refused, getattr(refusal, "reason", str(refusal)))
        return self.replacement(*args, **kwargs)

    def _program(self, args: tuple, kwargs: dict) -> Any:
        """Record the program on the stock tower, compile the stack and build its buckets on the recorded inputs;
        returns the stock output. A call the stock tower fails on as written too raises that error (the caller's
        input), not a refusal of the tower."""
        try:
            with routed_attention(self.tower):
                recorded = record_block_program(self.tower, args, kwargs)
        except BlocksRefused as refusal:
            raise self._refusal(str(refusal)) from None
        except Exception as error:
            self.tower(*args, **kwargs)  # the stock tower as written: its own error where the call is bad input
            raise self._refusal(
                "the stock tower fails with its attention routed through vgraph's varlen op "
                f"({first_line(error)}): its blocks do not attend over packed rows with cu_seqlens"
            ) from error
        compiled = self._compile(recorded)  # its traces route attention (``around_trace``)
        program = recorded.program
        proxies = torch.nn.ModuleList(_BlockProxy(self, index) for index in range(program.blocks))
        self.__dict__["served"] = _served_copy(self.tower, program.path, proxies)
        self.__dict__["compiled"] = compiled
        self.__dict__["program"] = program
        log.info("%s: block graphs serve %s", type(self.tower).__name__, program.describe())
        return recorded.output

    def _compile(self, recorded: Recorded) -> list:
        """Each segment's stack compiled by vgraph and traced on its recorded inputs; ``BlocksRefused`` with the
        trace's reason when the blocks cannot be one graph either."""
        program = recorded.program
        blocks = self.tower.get_submodule(program.path)
        compiled = []
        for segment, (hidden, inputs) in zip(program.segments, recorded.segment_inputs):
            if segment.host_list is not None:
                compiled.append(None)
                continue
            values = (hidden, *inputs)
            squeezed = tuple(_squeezed(value) for value in values)
            stack = BlockStack(blocks[segment.first : segment.stop], segment, program.output_leaf, squeezed)
            compiled.append(
                CompiledEncoderFunction(stack, self.vgraph_config, around_trace=lambda: routed_attention(self.tower))
            )
            try:
                compiled[-1](*(value[0] if squeeze else value for value, squeeze in zip(values, squeezed)))
            except Exception as error:
                reason = f"its blocks ({program.describe()}) are not one graph either: {first_line(error)}"
                raise self._refusal(reason) from error
        return compiled

    def _refusal(self, reason: str) -> BlocksRefused:
        both = f"the whole forward is not one graph ({self.tier_reason}), and {reason}"
        refusal = BlocksRefused(f"{type(self.tower).__name__} cannot be served by vgraph graphs: {both}")
        refusal.reason = both
        return refusal

    def _with_host_values(self, call: _StackCall, index: int, args: tuple, kwargs: dict) -> dict:
        """The block's keywords with the host values its program computes for it (``HostValue``), each computed once
        per call and inputs."""
        if index >= self.program.blocks:
            return kwargs
        segment = self.program.segment_of(index)
        host_values = segment.calls[index - segment.first].host_values if segment.host_list is None else ()
        if not host_values:
            return kwargs
        leaves = flatten_arguments(args, kwargs)[0]
        kwargs = dict(kwargs)
        with routed_attention(self.tower):  # as recorded: the function reads the attention the config selects
            for value in host_values:
                key = (value.function, value.key, *(id(leaves[value.arguments[name]]) for name in value.tensor_leaves))
                if key not in call.host_memo:
                    call.host_memo[key] = value.compute(leaves)
                kwargs[value.key] = call.host_memo[key]
        return kwargs

    def _block(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A proxy's call: the threaded hidden states for every block but a segment's last, whose call replays the
        segment's graph."""
        call: _StackCall | None = getattr(self._local, "call", None)
        if call is None:
            raise _OffProgram("a block was called outside the tower's forward")
        kwargs = self._with_host_values(call, index, args, kwargs)
        segment = call.take(index, args, kwargs)
        if segment.host_list is not None:
            return self.tower.get_submodule(self.program.path)[index](*args, **kwargs)
        program = self.program
        leaves = [None] * program.output_spec.num_leaves
        if index + 1 < segment.stop:
            leaves[program.output_leaf] = call.hidden  # never read by the glue: the next block takes it
            return pytree.tree_unflatten(leaves, program.output_spec)
        compiled = self.compiled[program.segments.index(segment)]
        stack: BlockStack = compiled.target
        values = (call.hidden, *call.inputs)
        if tuple(_squeezed(value) for value in values) != stack.squeezed:
            raise _OffProgram("an input of the stack changed its leading dim")
        hidden = compiled(*(value[0] if squeeze else value for value, squeeze in zip(values, stack.squeezed)))
        leaves[program.output_leaf] = hidden[None] if stack.squeezed[0] else hidden
        return pytree.tree_unflatten(leaves, program.output_spec)


def compile_block_tower(
    tower: torch.nn.Module,
    tier_reason: str,
    token_budgets: list[int] | tuple[int, ...] | None = None,
    blocks_refused: Callable[[str], torch.nn.Module] | None = None,
    **options: Any,
) -> CompiledBlockTower:
    """Serve ``tower``'s block stack from vgraph bucket graphs and its glue as written (see the module docstring).

    ``token_budgets`` count rows of the blocks' hidden states (patches for most towers); other ``options`` are
    ``VGraphConfig`` fields (``max_segments`` bounds the attention segments of one call, windows included).
    ``tier_reason`` is why the whole-tower graph does not serve it. The program is recorded at the first call,
    which the stock tower serves. Where the blocks cannot be one graph, ``blocks_refused`` is called with both
    tiers' reasons and the module it returns serves that call and every later one (``compile_vision_tower`` passes
    the exact-size code); without it the tower is refused then, with a ValueError (``BlocksRefused``) naming them.
    """
    config = VGraphConfig(token_budgets=tuple(token_budgets) if token_budgets is not None else None, **options)
    return CompiledBlockTower(tower, config, tier_reason, blocks_refused)
