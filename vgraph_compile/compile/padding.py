"""Padding rules: how a real input fills its bucket's persistent buffer, one rule per ``Role``.

Invariant: after ``fill``, ``buffer[:n]`` (along the padded dim) equals the input, and the rest holds the role's
padding, whatever the buffer held before. No rule reads device data on the host: the one size a rule needs
beyond the value's own (the real size of the dim a PLACEMENT_INDEX writes) comes from the call's plan. Each rule
is on the per-call path: a copy and at most one padding op, none when the input fills the buffer.
"""

from __future__ import annotations

from typing import Callable

import torch

from vgraph_compile.spec import Role

__all__ = ["fill", "fill_empty", "RULES", "WRITTEN_SIZE_ROLES"]


def _zeros(buffer: torch.Tensor, value: torch.Tensor) -> None:
    rows = value.shape[0]
    if buffer.shape[1:] == value.shape[1:]:  # padded along dim 0 (token rows) or not at all: one or two ops
        buffer[:rows].copy_(value)
        if rows < buffer.shape[0]:
            buffer[rows:].zero_()
        return
    differing = [d for d in range(buffer.dim()) if buffer.shape[d] != value.shape[d]]
    if len(differing) == 1:
        (dim,) = differing
        size = value.shape[dim]
        buffer.narrow(dim, 0, size).copy_(value)
        buffer.narrow(dim, size, buffer.shape[dim] - size).zero_()
        return
    buffer.zero_()
    buffer[tuple(slice(0, size) for size in value.shape)].copy_(value)


def _repeat_last(buffer: torch.Tensor, value: torch.Tensor) -> None:
    rows = value.shape[0]
    buffer[:rows].copy_(value)
    if rows < buffer.shape[0]:
        buffer[rows:].copy_(value[-1:].expand(buffer.shape[0] - rows))


def _repeat_last_per_half(buffer: torch.Tensor, value: torch.Tensor) -> None:
    source, target = value.shape[0] // 2, buffer.shape[0] // 2
    _repeat_last(buffer[:target], value[:source])
    _repeat_last(buffer[target:], value[source:])


def _from_written(buffer: torch.Tensor, value: torch.Tensor, written: int) -> None:
    """Padded entries ``written, written + 1, ...``: each the next row past the ``written`` real rows of the dim
    the index writes, so none is a real row and no two are equal."""
    rows = value.shape[0]
    buffer[:rows].copy_(value)
    if rows < buffer.shape[0]:
        torch.arange(written, written + buffer.shape[0] - rows, out=buffer[rows:])


def _identity(buffer: torch.Tensor, value: torch.Tensor) -> None:
    _from_written(buffer, value, value.shape[0])


RULES: dict[Role, Callable[..., None]] = {
    Role.TOKENS: _zeros,
    Role.STATIC: _zeros,
    Role.SEGMENT_LENGTHS: _zeros,
    Role.TABLE_INDEX: _zeros,
    Role.SEGMENT_OFFSETS: _repeat_last,
    Role.PACKED_OFFSETS: _repeat_last_per_half,
    Role.GATHER_INDEX: _identity,
    Role.SCATTER_INDEX: _identity,
    Role.PLACEMENT_INDEX: _from_written,
}
"""Role -> rule ``(buffer, value)``; the rules of ``WRITTEN_SIZE_ROLES`` take ``(buffer, value, written)``."""

WRITTEN_SIZE_ROLES = frozenset({Role.PLACEMENT_INDEX})
"""Roles whose rule also reads the call's real size of the dim the input writes (``CallPlan.written``)."""


def fill(role: Role, buffer: torch.Tensor, value: torch.Tensor, written: int | None = None) -> None:
    """Copy ``value`` into ``buffer`` and pad the rest by ``role``'s rule; ``written`` is the call's real size of
    the dim the input writes, for the roles of ``WRITTEN_SIZE_ROLES`` (None for the others)."""
    if written is None:
        RULES[role](buffer, value)
    else:
        RULES[role](buffer, value, written)


def fill_empty(role: Role, buffer: torch.Tensor) -> None:
    """Fill ``buffer`` as for a call with no tokens: one offset 0 (two for packed offsets), no rows."""
    rows = {Role.SEGMENT_OFFSETS: 1, Role.PACKED_OFFSETS: 2}.get(role, 0)
    fill(role, buffer, buffer.new_zeros((rows, *buffer.shape[1:])), 0 if role in WRITTEN_SIZE_ROLES else None)
