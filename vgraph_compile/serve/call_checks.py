"""Per-call checks of one traced encoder: what a call's sizes decide (its plan) and whether its inputs are valid.

``CallChecks.check(args)`` reads the real sizes, validates every input against what the trace assumed (dtype,
device, static dims, cu_seqlens values) and returns the call's plan. It raises a ValueError in the user's names
before anything runs; the backend runs it on the first call's values before anything compiles, the runtime on
every later call (the hot path skips dynamo's guards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import sympy
import torch

from vgraph_compile.serve.fills import WRITTEN_SIZE_ROLES
from vgraph_compile.spec import PassContext, Role, VarlenSpec

if TYPE_CHECKING:
    from vgraph_compile.config import VGraphConfig
from vgraph_compile.symbolic import evaluate

__all__ = ["CallChecks", "CallPlan"]

_PLAN_CACHE_SIZE = 4096


@dataclass(frozen=True)
class CallPlan:
    """What a call's sizes decide, computed once per distinct sizes (sympy stays off the hot path)."""

    key: tuple[int, ...]
    sizes: dict[sympy.Symbol, int]
    tokens: int
    ends: dict[int, int]
    """Per offsets input (by index): the row count its last entry must equal, where the graph states one."""
    written: dict[int, int]
    """Per input whose padding rule reads it (``fills.WRITTEN_SIZE_ROLES``): the real size of the dim it writes."""
    narrow: tuple[tuple[tuple[int, int], ...] | int | None, ...]
    """Per output: (dim, real size) pairs to narrow a tensor to, its value for an int output, or None."""


@dataclass(frozen=True)
class _TensorContract:
    """What the trace assumed of a tensor input: checked per call, since the hot path skips dynamo's guards."""

    index: int
    name: str
    dtype: torch.dtype
    device: torch.device
    static: tuple[int | None, ...]
    """Per dim: its fixed size, or None where it varies with the call."""
    fixed: tuple[tuple[int, int], ...]
    """(dim, size) of each fixed dim of ``static``: what a call is checked against."""


class CallChecks:
    """The checks and plans of one trace's calls; plans are cached per distinct sizes."""

    def __init__(
        self, spec: VarlenSpec, config: "VGraphConfig", tensors: Mapping[int, tuple[torch.dtype, torch.device]]
    ) -> None:
        """``tensors``: the dtype and device of each tensor input that is not module state, by graph input index."""
        self.spec = spec
        self.config = config
        self._plans: dict[tuple[int, ...], CallPlan] = {}
        self._offsets = [role for role in self.spec.inputs if role.role is Role.SEGMENT_OFFSETS]
        self._writers = [role for role in self.spec.inputs if role.role in WRITTEN_SIZE_ROLES]
        self._max_seqlen = {
            group.offsets_input: group.max_seqlen_inputs for group in self.spec.groups if group.max_seqlen_inputs
        }
        self._contracts = []
        for index, (dtype, device) in sorted(tensors.items()):
            shape = spec.input_shapes[index]
            static = tuple(int(size) if not getattr(size, "free_symbols", ()) else None for size in shape)
            fixed = tuple((dim, size) for dim, size in enumerate(static) if size is not None)
            self._contracts.append(_TensorContract(index, spec.describe_input(index), dtype, device, static, fixed))

    @classmethod
    def from_context(cls, ctx: PassContext) -> "CallChecks":
        """The checks of the trace in ``ctx``: its tensor inputs as traced."""
        tensors = {
            role.index: (value.dtype, value.device)
            for role, value in zip(ctx.spec.inputs, ctx.example_inputs)
            if isinstance(value, torch.Tensor) and role.role is not Role.PARAMETER
        }
        return cls(ctx.spec, ctx.config, tensors)

    def check(self, args: Sequence[Any]) -> CallPlan:
        """The call's plan, after its inputs passed every check (a ValueError saying what to fix otherwise)."""
        self._check_contract(args)
        plan = self._plan(args)
        self._check_offsets(args, plan)
        return plan

    def _plan(self, args: Sequence[Any]) -> CallPlan:
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
        written = {
            role.index: evaluate(role.indexed, sizes, f"the dim {self.spec.describe_input(role.index)} writes")
            for role in self._writers
        }
        tokens = evaluate(self.spec.token_rows, sizes, "the token rows")
        plan = CallPlan(key, sizes, tokens, ends, written, tuple(narrow))
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
            shape = value.shape
            if len(shape) != len(contract.static) or any(shape[dim] != size for dim, size in contract.fixed):
                expected = ", ".join("any" if size is None else str(size) for size in contract.static)
                raise ValueError(
                    f"{contract.name} has shape {tuple(value.shape)}, but the encoder takes [{expected}] "
                    "(only the packed dims vary between calls)"
                )

    def _check_offsets(self, args: Sequence[Any], plan: CallPlan) -> None:
        for role in self._offsets:
            offsets = args[role.index]
            if offsets.dim() != 1 or offsets.shape[0] < 2:
                raise ValueError(
                    f"{self.spec.describe_input(role.index)}: cu_seqlens must be 1-D with at least 2 entries [0, ..., tokens], "
                    f"got shape {tuple(offsets.shape)}"
                )
        if not self.config.check_values or not self._offsets:
            return
        for role, values in zip(self._offsets, _to_host([args[role.index] for role in self._offsets])):
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


def _to_host(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The values of 1-D tensors as lists, in one device-to-host read (on an accelerator each read waits for the
    device: one wait per call, not one per tensor)."""
    if len(tensors) == 1:
        return [tensors[0].tolist()]
    flat = torch.cat(tensors).tolist()
    lists, start = [], 0
    for tensor in tensors:
        lists.append(flat[start : start + tensor.shape[0]])
        start += tensor.shape[0]
    return lists
