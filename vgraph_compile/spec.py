"""What the analyses learn about a traced encoder: input roles, varlen sites, attention groups, bucket shapes.

All frozen and printable; passes read them, only ``discover`` and ``bounds`` produce them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

if TYPE_CHECKING:
    import sympy
    import torch

    from vgraph_compile.config import VGraphConfig


class StaticTokensError(ValueError):
    """The trace fixed the attention's row count: it serves one token count only."""


def user_name(name: str) -> str:
    """A graph input's name as the user wrote it: dynamo's ``l_x_`` -> ``x``, and a module's own state
    ``l_self_modules_blocks_modules_0_parameters_weight_`` -> ``self.blocks.0.weight``."""
    if name.startswith("l_") and name.endswith("_"):
        name = name[2:-1]
    if name.startswith("self_"):
        name = re.sub(r"_(?:modules|parameters|buffers)_", ".", name)
    return name


class Role(str, enum.Enum):
    """What a graph input is, found from data flow; each role has one padding rule (``serve/fills.py``)."""

    TOKENS = "tokens"
    """Tensor with token-sized dims: copied, the padded rows zeroed."""
    SEGMENT_OFFSETS = "segment_offsets"
    """cu_seqlens of one attention group: copied, padded by repeating the last offset (empty segments)."""
    QKV_OFFSETS = "qkv_offsets"
    """FlashInfer's ``[Q/K/O offsets | V offsets]`` buffer: each half padded by repeating its own last value."""
    SEGMENT_LENGTHS = "segment_lengths"
    """Per-segment lengths the graph turns into offsets (cumsum): padded with zeros (empty segments)."""
    GATHER_INDEX = "gather_index"
    """Integer index into a token-sized dim (e.g. a window permutation): padded with the identity, so padded
    rows only ever gather padded rows."""
    SCATTER_INDEX = "scatter_index"
    """Integer index that writes rows (``index_copy``, ``index_put``, ``scatter``, ``x[index] = ...``) into a dim
    exactly as long as itself (e.g. an inverse window permutation): padded with the identity, so each padded entry
    writes a padding row (the rows past the real count), never a real row."""
    PLACEMENT_INDEX = "placement_index"
    """Integer index whose values the graph uses as is to write rows into a dim longer than itself by positive
    multiples of sizes (patch rows, or a CLS row per image, placed into ``patches + images`` rows): its padded
    entries point at the rows from the call's real size of that dim upward, one each, which are padding rows of
    the bucket's destination (every size at most its bucket's keeps them in range), never real rows."""
    TABLE_INDEX = "table_index"
    """Integer index into a fixed-size table (e.g. a position embedding): padded with 0, a valid entry."""
    MAX_SEQLEN = "max_seqlen"
    """Python int bounding a group's segment length: becomes the bucket's constant bound."""
    SIZE = "size"
    """Python int that is a traced size (dynamo lifts these): folded to the bucket's value."""
    PARAMETER = "parameter"
    """Module parameter or buffer: used in place by every bucket graph, never copied."""
    STATIC = "static"
    """Any other tensor with no symbolic size: copied as is."""


@dataclass(frozen=True)
class InputRole:
    index: int
    name: str
    role: Role
    dims: tuple[int, ...] = ()
    """Dims whose size is symbolic (padded up to the bucket); for ints, empty."""
    group: int | None = None
    """Attention group of SEGMENT_OFFSETS / SEGMENT_LENGTHS / MAX_SEQLEN inputs."""
    indexed: "sympy.Expr | None" = None
    """For GATHER_INDEX / SCATTER_INDEX: size of the dim it reads or writes, which bounds its length; for
    PLACEMENT_INDEX: size of the dim it writes, whose real size per call is where its padded entries start."""

    def format(self) -> str:
        parts = [f"{user_name(self.name)}: {self.role.value}"]
        if self.dims:
            parts.append(f"dims={list(self.dims)}")
        if self.group is not None:
            parts.append(f"group={self.group}")
        return " ".join(parts)


class Binding(NamedTuple):
    """Where a size symbol's value is read per call: ``inputs[input].shape[dim]``, or the int ``inputs[input]``
    when ``dim`` is None. A tuple ``(symbol, input, dim)``, so ``for symbol, index, dim in spec.bindings`` reads it."""

    symbol: "sympy.Symbol"
    input: int
    dim: int | None


@dataclass(frozen=True)
class VarlenSite:
    """One varlen-attention call in the graph."""

    node: str
    group: int
    rows: "sympy.Expr"
    """Packed row count of its q (the token expression the budgets are counted in)."""


@dataclass(frozen=True)
class AttentionGroup:
    """Sites sharing one cu_seqlens input (e.g. full attention vs window attention)."""

    index: int
    offsets_input: int
    segments: "sympy.Expr"
    """Segment count as an expression of the offsets input's length."""
    max_seqlen_inputs: tuple[int, ...]
    sites: tuple[str, ...]
    ends_at: "sympy.Expr | None" = None
    """The row count the offsets input's last entry equals (its sites' rows) when every site reads the input as
    is; None when the graph transforms the offsets first (e.g. ``cu_seqlens + arange`` for a CLS row per image),
    so the input ends at a count the graph does not state."""


@dataclass(frozen=True)
class VarlenSpec:
    """Result of ``discover``: how the encoder's inputs vary and what bounds them."""

    inputs: tuple[InputRole, ...]
    sites: tuple[VarlenSite, ...]
    groups: tuple[AttentionGroup, ...]
    token_rows: "sympy.Expr"
    """Packed rows of the first site, with every relation applied: a constant plus positive multiples of symbols
    (e.g. ``patches + images`` with a CLS row per image); the budgets bound it."""
    bindings: tuple[Binding, ...]
    """Where each free symbol's value is read per call."""
    input_shapes: tuple[tuple["sympy.Expr | int", ...] | None, ...]
    """Per input, its shape with replacements applied (None for ints)."""
    outputs: tuple[tuple["sympy.Expr | int", ...] | "sympy.Expr | None", ...]
    """Per output, its shape (tensors), its value expression (ints), or None (other constants)."""
    features: Mapping["sympy.Symbol", int] = field(default_factory=dict)
    """Feature widths ``dynamic=True`` left symbolic, at their traced values (pinned in every bucket)."""
    relations: Mapping["sympy.Symbol", "sympy.Expr"] = field(default_factory=dict)
    """Sizes the graph ties to others (a reshape of ``[n, 4, d]`` into ``[tokens, d]``: tokens = 4 n): each
    symbol here equals its expression in the remaining ones, in every call the graph can run."""

    @property
    def token_symbols(self) -> tuple["sympy.Symbol", ...]:
        """The symbols the token rows are a sum of, sorted by name."""
        return tuple(sorted(self.token_rows.free_symbols, key=str))

    def describe(self, symbol: "sympy.Symbol") -> str:
        """A size symbol in the user's terms: ``patches.shape[0]`` or ``max_seqlen`` (dynamo's ``l_x_`` -> ``x``)."""
        places = [(index, dim) for bound, index, dim in self._all_bindings() if bound == symbol]
        places.sort(key=lambda place: place[1] is None)
        if not places:
            return str(symbol)
        index, dim = places[0]
        name = user_name(self.inputs[index].name)
        return name if dim is None else f"{name}.shape[{dim}]"

    def describe_input(self, index: int) -> str:
        """Input ``index`` by the user's argument name."""
        return user_name(self.inputs[index].name)

    def describe_expr(self, expr: "sympy.Expr") -> str:
        """An expression of size symbols in the user's terms (``4*window_index.shape[0]``)."""
        import sympy

        names = {symbol: sympy.Symbol(self.describe(symbol)) for symbol in expr.free_symbols}
        return str(expr.xreplace(names))

    def _all_bindings(self):
        yield from self.bindings
        for index, shape in enumerate(self.input_shapes):
            for dim, size in enumerate(shape or ()):
                if getattr(size, "is_Symbol", False):
                    yield size, index, dim

    def format(self) -> str:
        """The spec in the user's terms: input names and dims, never dynamo's symbol ids."""
        lines = [f"tokens: {self.describe_expr(self.token_rows)}"]
        for symbol, expr in sorted(self.relations.items(), key=lambda item: self.describe(item[0])):
            lines.append(f"relation: {self.describe(symbol)} == {self.describe_expr(expr)}")
        for group in self.groups:
            offsets = user_name(self.inputs[group.offsets_input].name)
            segments = self.describe_expr(group.segments)
            lines.append(f"group {group.index}: offsets={offsets} segments={segments} sites={list(group.sites)}")
        for role in self.inputs:
            if role.role is Role.SIZE:
                continue  # dynamo's lifted sizes: shown as the input dims they are
            if role.role is not Role.PARAMETER:
                lines.append(f"input {role.format()}")
        state = sum(role.role is Role.PARAMETER for role in self.inputs)
        lines.append(f"inputs: {state} parameters and module state (used in place)")
        return "\n".join(lines)


@dataclass(frozen=True)
class BucketShape:
    """Static size of every symbol for one token budget (result of ``bounds``)."""

    budget: int
    values: Mapping["sympy.Symbol", int]
    segments: tuple[int, ...]
    """Segment capacity per attention group."""
    max_seqlen: tuple[int, ...]
    """Constant max_seqlen per attention group."""
    fixed: frozenset["sympy.Symbol"] = frozenset()
    """Symbols no budget bounds, fixed at their traced value: a call must match them exactly."""

    def format(self, spec: VarlenSpec | None = None) -> str:
        """One line; with ``spec``, sizes by the user's names (``patches.shape[0]<=64``), else by symbol."""
        name = spec.describe if spec is not None else str
        values = " ".join(
            sorted(f"{name(s)}{'==' if s in self.fixed else '<='}{value}" for s, value in self.values.items())
        )
        return f"budget {self.budget}: segments={list(self.segments)} max_seqlen={list(self.max_seqlen)} ({values})"


@dataclass(frozen=True)
class DroppedBucket:
    """A budget given up, and why in the user's terms: the guard that fails at its size and the op whose trace (or
    compile) made it, or what ran out."""

    budget: int
    reason: str

    def format(self) -> str:
        return f"budget {self.budget} dropped: {self.reason}"


def guard_origin(guard: Any) -> str:
    """Where a ShapeEnv guard came from, as dynamo records it (the user's line, then the framework's op line)."""
    origin = str(getattr(guard, "sloc", "") or "").strip()
    return origin or "an unrecorded place"


@dataclass
class PassContext:
    """What every pass may read: the trace, its ShapeEnv, the config; analyses fill ``spec`` and ``buckets``."""

    example_inputs: list[Any]
    shape_env: Any
    config: "VGraphConfig"
    device: "torch.device"
    """Where the encoder runs (its first tensor input's device)."""
    spec: VarlenSpec | None = None
    buckets: tuple[BucketShape, ...] = ()
    kernels: Mapping[int, str] = field(default_factory=dict)
    """Attention group -> kernel the build measured as fastest (``attention_backend="auto"`` on CUDA)."""
    dropped: list[DroppedBucket] = field(default_factory=list)
    """Budgets the analyses or the compile gave up, each with its reason (``stats_table()`` lists them)."""
