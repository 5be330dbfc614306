"""Splitting one call into two at a segment boundary, each half served by its own bucket, outputs joined.

Legality (``can_split``) is a property of the trace, checked once: one attention group whose offsets the graph
reads as they are and end at the token rows, token rows that are one size (no relation such as ``patches +
images``), every input a per-row tensor of those rows (``TOKENS``, ``TABLE_INDEX``), the offsets, a
``max_seqlen``, a size that is the token rows or the offsets' length, module state or a static tensor, and every output a tensor whose
one varying dim is the token rows. Then rows of different segments never meet, so the first ``offsets[k]`` rows
are a call of their own (segments ``0..k-1``), as are the rest (offsets shifted down by ``offsets[k]``), and the
outputs of the two, concatenated along the token dim, are the call's outputs. Profitability is the runtime's
(``serve/runtime``, from the measured cost table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from vgraph_compile.spec import Role, VarlenSpec

__all__ = ["Splitter", "can_split"]

_PER_ROW = (Role.TOKENS, Role.TABLE_INDEX)
_AS_IS = (Role.PARAMETER, Role.STATIC)


def can_split(spec: VarlenSpec) -> bool:
    """Whether every call of this trace can be served as two calls split at a segment boundary (module docstring)."""
    rows = spec.token_rows
    if len(spec.groups) != 1 or not rows.is_Symbol or spec.groups[0].ends_at != rows:
        return False
    group = spec.groups[0]
    int_symbols = {index: symbol for symbol, index, dim in spec.bindings if dim is None}
    offsets_length = spec.input_shapes[group.offsets_input][0]
    for role, shape in zip(spec.inputs, spec.input_shapes):
        if role.role in _PER_ROW:
            if any(shape[dim] != rows for dim in role.dims) or not role.dims:
                return False
        elif role.role is Role.SEGMENT_OFFSETS:
            if role.index != group.offsets_input:
                return False
        elif role.role is Role.MAX_SEQLEN:
            if role.index not in group.max_seqlen_inputs:
                return False
        elif role.role is Role.SIZE:
            if int_symbols.get(role.index) not in (rows, offsets_length):
                return False
        elif role.role not in _AS_IS:
            return False
    for shape in spec.outputs:
        if not isinstance(shape, tuple) or [size for size in shape if getattr(size, "free_symbols", ())] != [rows]:
            return False
    return True


@dataclass(frozen=True)
class Splitter:
    """How to cut a legal trace's calls (``can_split``) and join their outputs."""

    spec: VarlenSpec

    @property
    def _sizes(self) -> dict[int, bool]:
        """Per size input: True where it is the token rows, False where it is the offsets' length."""
        symbols = {index: symbol for symbol, index, dim in self.spec.bindings if dim is None}
        return {
            role.index: symbols[role.index] == self.spec.token_rows
            for role in self.spec.inputs
            if role.role is Role.SIZE
        }

    @property
    def offsets_input(self) -> int:
        return self.spec.groups[0].offsets_input

    def halves(self, args: Sequence[Any], offsets: list[int], segment: int) -> tuple[list[Any], list[Any]]:
        """The graph inputs of the two calls: segments ``[0, segment)`` and ``[segment, end)`` (``offsets``: the
        call's offsets on the host)."""
        cut, sizes = offsets[segment], self._sizes
        halves = []
        for begin, end, first, last in ((0, cut, 0, segment), (cut, offsets[-1], segment, len(offsets) - 1)):
            longest = max(b - a for a, b in zip(offsets[first:last], offsets[first + 1 : last + 1]))
            half = []
            for role, value in zip(self.spec.inputs, args):
                if role.role in _PER_ROW:
                    for dim in role.dims:
                        value = value.narrow(dim, begin, end - begin)
                elif role.role is Role.SEGMENT_OFFSETS:
                    value = value[first : last + 1] - begin
                elif role.role is Role.MAX_SEQLEN:
                    value = longest
                elif role.role is Role.SIZE:
                    value = end - begin if sizes[role.index] else last - first + 1
                half.append(value)
            halves.append(half)
        return halves[0], halves[1]

    def join(self, first: Sequence[Any], second: Sequence[Any]) -> list[Any]:
        """The call's outputs: each output of the halves concatenated along its token dim."""
        rows = self.spec.token_rows
        joined = []
        for shape, a, b in zip(self.spec.outputs, first, second):
            joined.append(torch.cat([a, b], dim=list(shape).index(rows)))
        return joined
