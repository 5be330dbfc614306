"""Fills: how a call's real inputs fill a bucket's persistent buffers, one rule per ``Role``.

Invariant: after ``fill``, ``buffer[:n]`` (along the padded dim) equals the input, and the rest holds the role's
padding, whatever the buffer held before. No rule reads device data on the host: the one size a rule needs
beyond the value's own (the real size of the dim a PLACEMENT_INDEX writes) comes from the call's plan. Each rule
is on the per-call path: a copy and at most one padding op, none when the input fills the buffer.

``RowFills`` batches the common case (``ZEROS`` padded along dim 0 only, the token rows) of every buffer of one
call: their copies, together with any other byte copies (a staged metadata region), go in one
``torch._foreach_copy_`` and their zero tails in one ``torch._foreach_zero_``, over byte views, so a call costs
two launches for all of them instead of two per buffer. ``BucketFills`` holds one bucket's rules, looked up once;
``StagedFill`` is its fill for the calls of one key at one set of sizes, every view made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from vgraph_compile.compile.buckets import Bucket
from vgraph_compile.spec import Role

__all__ = [
    "BucketFills", "fill", "fill_empty", "empty_bucket", "RowFills", "RULES", "StagedFill", "WRITTEN_SIZE_ROLES",
    "ZEROS",
]

_ROW_VIEWS = 4096
"""At most this many cached row views per bucket (``BucketFills.row_views``; cleared past it)."""


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


ZEROS = _zeros
"""The rule of the token rows (and of every role padded with zeros): the one ``RowFills`` batches."""


def _bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as a uint8 view (its last dim widened by the element size), or None where no such view exists
    (a 0-dim tensor, or a last dim that is not contiguous)."""
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        return None
    return tensor.view(torch.uint8)


def _row_views(views: dict, index: int, buffer: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The byte views of ``buffer``'s first ``rows`` rows and of the rest (None when the rows fill it), cached in
    ``views`` per (input index, rows). Made outside inference mode: a dtype view made under
    ``torch.inference_mode`` is an inference tensor, which a later call under ``no_grad`` could not write."""
    cached = views.get((index, rows))
    if cached is None:
        with torch.inference_mode(False):
            tail = _bytes(buffer[rows:]) if rows < buffer.shape[0] else None
            cached = views[index, rows] = (_bytes(buffer[:rows]), tail)
    return cached


class RowFills:
    """One call's batched fills: ``add`` the buffers padded with zeros along dim 0 and other byte copies, then
    ``run`` them in one copy launch and one zero launch (``torch._foreach_copy_``, ``torch._foreach_zero_``; both
    fall back to a copy per tensor where the fast path does not apply, with the same result).

    ``views`` caches, per (buffer, rows), the byte views of the buffer's first ``rows`` rows and of the rest
    (``_row_views``), so a call slices nothing it sliced before."""

    def __init__(self, views: dict) -> None:
        self.views = views
        self.destinations: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.tails: list[torch.Tensor] = []

    def add(self, index: int, buffer: torch.Tensor, value: torch.Tensor) -> bool:
        """Queue ``ZEROS``' fill of ``buffer`` by ``value`` when it pads along dim 0 only and both have byte views;
        False (nothing queued) otherwise: the caller runs the rule."""
        if value.dim() == 0 or buffer.shape[1:] != value.shape[1:]:
            return False
        source = _bytes(value)
        if source is None:
            return False
        destination, tail = _row_views(self.views, index, buffer, value.shape[0])
        self.destinations.append(destination)
        self.sources.append(source)
        if tail is not None:
            self.tails.append(tail)
        return True

    def add_copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue a plain copy of two byte tensors of one shape (a staged metadata region)."""
        self.destinations.append(destination)
        self.sources.append(source)

    def run(self) -> None:
        if self.destinations:
            torch._foreach_copy_(self.destinations, self.sources)
        if self.tails:
            torch._foreach_zero_(self.tails)


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
    Role.QKV_OFFSETS: _repeat_last_per_half,
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
    """Fill ``buffer`` as for a call with no tokens: one offset 0 (two for Q/K/O|V offsets), no rows."""
    rows = {Role.SEGMENT_OFFSETS: 1, Role.QKV_OFFSETS: 2}.get(role, 0)
    fill(role, buffer, buffer.new_zeros((rows, *buffer.shape[1:])), 0 if role in WRITTEN_SIZE_ROLES else None)


def empty_bucket(bucket: Bucket, roles: Mapping[int, Role]) -> None:
    """Fill every buffer of ``bucket`` as for a call with no tokens (valid input for any kernel)."""
    for index, buffer in bucket.buffers.items():
        fill_empty(roles[index], buffer)


class BucketFills:
    """One bucket's fills: per buffer its role's rule (looked up once, not per call), and the cached row views."""

    def __init__(self, bucket: Bucket, roles: Mapping[int, Role]) -> None:
        self.bucket = bucket
        self.rules = tuple((RULES[roles[index]], buffer, index) for index, buffer in bucket.buffers.items())
        """Per buffer: its role's rule, the buffer and its graph input index."""
        self.token_rules = tuple(rule for rule in self.rules if rule[2] in bucket.tokens)
        """The ``rules`` of the token buffers (those outside the bucket's metadata ``region``)."""
        self.row_views: dict = {}
        """(input index, rows) -> the byte views ``RowFills`` copies into and zeroes (made once per rows)."""

    def staged_fill(self, args: Sequence[torch.Tensor], staged: torch.Tensor) -> StagedFill | None:
        """The fill of calls whose token inputs have the shapes of ``args``'s and whose metadata is ``staged``; None
        where some token buffer is not padded with zeros along its rows alone (its rule runs per call)."""
        tokens, destinations, tails = [], [], []
        for rule, buffer, index in self.token_rules:
            value = args[index]
            if rule is not ZEROS or value.dim() == 0 or buffer.shape[1:] != value.shape[1:]:
                return None
            destination, tail = _row_views(self.row_views, index, buffer, value.shape[0])
            tokens.append(index)
            destinations.append(destination)
            if tail is not None:
                tails.append(tail)
        return StagedFill(tuple(tokens), [*destinations, self.bucket.region], staged, tails)

    def fill(self, args: Sequence[torch.Tensor], written: Mapping[int, int], staged: torch.Tensor | None = None) -> None:
        """Fill every buffer from a call's graph inputs by its role's rule; ``written`` gives, per input of
        ``WRITTEN_SIZE_ROLES``, the call's real size of the dim it writes (``CallPlan.written``). With ``staged``
        (the ``region`` bytes an earlier fill left for the same metadata), the metadata buffers take them in one
        copy and only the token buffers are filled by their rules. The copies of the buffers padded with zeros
        along their rows and the staged copy go in one launch, their padding in one more (``RowFills``)."""
        batch = RowFills(self.row_views)
        for rule, buffer, index in self.rules if staged is None else self.token_rules:
            if index in written:
                rule(buffer, args[index], written[index])
            elif rule is not ZEROS or not batch.add(index, buffer, args[index]):
                rule(buffer, args[index])
        if staged is not None:
            batch.add_copy(self.bucket.region, staged)
        batch.run()
        if len(self.row_views) > _ROW_VIEWS:
            self.row_views.clear()


@dataclass(frozen=True)
class StagedFill:
    """One bucket's fill for the calls of one key (``BucketFills.staged_fill``): each token input's rows copied as
    bytes into its buffer's first rows and the key's staged metadata bytes into the region, in one copy launch, and
    the token buffers' padding rows zeroed in one more. Every view is made once; valid for token inputs of the
    shapes it was made for (the caller checks them)."""

    tokens: tuple[int, ...]
    """The graph input index of each token input, in the order of ``destinations``."""
    destinations: list[torch.Tensor]
    """The byte views of each token buffer's first rows, then the bucket's region."""
    staged: torch.Tensor
    tails: list[torch.Tensor]

    def fill(self, args: Sequence[torch.Tensor]) -> bool:
        """Fill the bucket from a call's graph inputs; False, with nothing written, where a token input has no byte
        view (a last dim that is not contiguous: the rules fill it)."""
        sources = [_bytes(args[index]) for index in self.tokens]
        if any(source is None for source in sources):
            return False
        sources.append(self.staged)
        torch._foreach_copy_(self.destinations, sources)
        if self.tails:
            torch._foreach_zero_(self.tails)
        return True
