"""Padding rules: how a real input fills its bucket's persistent buffer, one rule per ``Role``.

Invariant: after ``fill``, ``buffer[:n]`` (along the padded dim) equals the input, and the rest holds the role's
padding, whatever the buffer held before. No rule reads device data on the host. Each rule is on the per-call
path: a copy and at most one padding op, none when the input fills the buffer.
"""

from __future__ import annotations

from typing import Callable

import torch

from vgraph_compile.spec import Role

__all__ = ["fill", "fill_empty", "RULES"]


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


def _identity(buffer: torch.Tensor, value: torch.Tensor) -> None:
    rows = value.shape[0]
    buffer[:rows].copy_(value)
    if rows < buffer.shape[0]:
        torch.arange(rows, buffer.shape[0], out=buffer[rows:])


RULES: dict[Role, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Role.TOKENS: _zeros,
    Role.STATIC: _zeros,
    Role.SEGMENT_LENGTHS: _zeros,
    Role.TABLE_INDEX: _zeros,
    Role.SEGMENT_OFFSETS: _repeat_last,
    Role.PACKED_OFFSETS: _repeat_last_per_half,
    Role.GATHER_INDEX: _identity,
    Role.SCATTER_INDEX: _identity,
}


def fill(role: Role, buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into ``buffer`` and pad the rest by ``role``'s rule."""
    RULES[role](buffer, value)


def fill_empty(role: Role, buffer: torch.Tensor) -> None:
    """Fill ``buffer`` as for a call with no tokens: one offset 0 (two for packed offsets), no rows."""
    rows = {Role.SEGMENT_OFFSETS: 1, Role.PACKED_OFFSETS: 2}.get(role, 0)
    fill(role, buffer, buffer.new_zeros((rows, *buffer.shape[1:])))
