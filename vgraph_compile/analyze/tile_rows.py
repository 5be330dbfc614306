"""Analysis: prove that a traced tower keeps the rows of its batch apart, and describe it for buckets over N.

A fixed-tile tower takes ``pixel_values[N, C, H, W]`` (and maybe per-tile inputs such as Idefics3's
``patch_attention_mask[N, h, w]``); only N varies. Buckets pad N with zero rows and drop them after the call, which
is exact only if no op lets one row reach another. This pass proves it.

Invariant: never mutates the graph. Every tensor node gets a *row dim*: the dim that indexes the tiles, or None
when its values depend on no tile (parameters, constants, sizes). A node's row dim follows from its inputs' by the
op's rule (``_TABLE``); a rule accepts only uses where output row i is a function of row i of each input:
- elementwise ops and casts: every tiled input's row dim lands on the same broadcast output dim;
- reductions, softmax, cumsum and norms: over dims other than the row dim (never over every dim);
- linear / matmul / einsum / attention: the row dim is a batch dim, never a contracted or sequence dim;
- convolutions, group/instance norm, interpolate: the row dim is dim 0; batch norm only with running stats;
- views and reshapes: the row dim survives as one dim with the same elements before it (``[N, L, D] -> [N, L*D]``),
  or becomes the outer factor of one (``[N, L, D] -> [N*L, D]``: ``Merged``, which a later reshape splits back;
  every other rule treats a merged dim as a batch dim, and no op may combine it with a plain tile dim);
- indexing with tensors: the tile dim's index is ``arange(N)`` (viewed, unsqueezed, expanded), so row i reads
  tile i (transformers' mask builders index ``mask[batch_idx, kv_idx]``);
  transposes, permutes, squeezes, slices, cat/stack/split: the row dim moves, and is never sliced, split or joined;
- creation ops (``arange``, ``ones``, ``new_zeros``, ``*_like``): no row dim, whatever their size.
A tiled input reaching an op with no rule, or a rule's use that mixes rows (batch statistics, attention across
tiles, a sum over dim 0, an index into the tile dim), is refused with a ValueError naming the node. Every output
must have its rows in dim 0. The spec (``ctx.spec``) has no varlen sites: its token rows are N, so
``bounds`` makes one bucket per budget of tiles, and the inputs with N in dim 0 are TOKENS (padded with zeros).
A static trace (``VGraphConfig.static_rows``: a fixed-tile tower's one-tile graph, ``hf/whole_graph/tiles``) has its one
budget as its token rows and serves calls of exactly that many tiles: nothing is padded, so it needs no proof.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx

from vgraph_compile.analyze.refusals import check_no_host_sync
from vgraph_compile.analyze.inputs import feature_sizes, graph_inputs, input_sizes, output_shapes, simplifier
from vgraph_compile.analyze.roles import other_roles
from vgraph_compile.config import VGraphConfig
from vgraph_compile.fx_utils import callable_name, example_value, writes_in_place
from vgraph_compile.counters import counters
from vgraph_compile.spec import DroppedBucket, PassContext, VarlenSpec, guard_origin

__all__ = ["run", "row_dims", "TileMixingError"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Merged:
    """The tiles are the outer factor of dim ``dim``: ``N * k`` rows there, tile i's k rows contiguous (Janus's
    attention reshapes ``[N, L, d]`` to ``[N*L, heads, d]``). Rules see ``dim``; only a reshape splits it back."""

    dim: int


RowDim = Any
"""None (no tile dependence), an int (the tile dim of a tensor), a ``Merged`` tile dim, or a tuple of these (a
tuple/list value)."""


def _kinds(row: RowDim) -> set[type]:
    if isinstance(row, tuple):
        return set().union(*map(_kinds, row)) if row else set()
    return set() if row is None else {type(row)}


def _unwrap(row: RowDim) -> RowDim:
    if isinstance(row, tuple):
        return tuple(map(_unwrap, row))
    return row.dim if isinstance(row, Merged) else row


def _wrap(row: RowDim) -> RowDim:
    if isinstance(row, tuple):
        return tuple(map(_wrap, row))
    return Merged(row) if isinstance(row, int) else row


class TileMixingError(ValueError):
    """An op lets one tile's values reach another tile's rows (or no rule proves it does not)."""


def _value(arg: Any) -> Any:
    return example_value(arg) if isinstance(arg, torch.fx.Node) else arg


def _ndim(arg: Any) -> int:
    return _value(arg).dim()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class _Rules:
    """The row-dim rules, each ``rule(node, rows) -> RowDim``; ``rows(arg)`` is an argument's row dim."""

    def __init__(self, simplify: Callable[[Any], sympy.Expr], tiles: sympy.Expr) -> None:
        self.simplify = simplify
        self.tiles = tiles
        self.merged = False
        """Whether the op being checked takes a merged tile dim (``Merged``, passed to the rule as its dim)."""
        self.iota: dict[torch.fx.Node, int] = {}
        """Nodes holding ``arange(N)`` along one dim (the dim), constant along the others: tile indices."""

    def track_iota(self, node: torch.fx.Node) -> None:
        """Record ``node`` in ``self.iota`` when it is ``arange(N)`` or a view/unsqueeze/expand/slice of one."""
        name = callable_name(node)
        if name == "arange" and len(node.args) == 1 and not node.kwargs.get("step"):
            if self.same_size(_value(node.args[0]), self.tiles):
                self.iota[node] = 0
            return
        if name in _IOTA_VIEWS and node.args and node.args[0] in self.iota:
            try:
                dim = getattr(self, _TABLE[name])(node, lambda arg: self.iota.get(arg))
            except TileMixingError:
                return
            if isinstance(dim, int):
                self.iota[node] = dim

    def same_size(self, a: Any, b: Any) -> bool:
        return sympy.simplify(self.simplify(a) - self.simplify(b)) == 0

    @staticmethod
    def refuse(node: torch.fx.Node, why: str) -> TileMixingError:
        stack = node.meta.get("stack_trace", "") or ""
        where = stack.strip().splitlines()[-2:] if stack else []
        return TileMixingError(
            f"{node.format_node()} ({callable_name(node)}) {why}: it would mix tiles, so the rows of the batch "
            f"cannot be served by padded buckets. {' '.join(line.strip() for line in where)}".strip()
        )

    # -- rules ----------------------------------------------------------------------------------------------
    def elementwise(self, node, rows):
        out = _value(node)
        ndim = out.dim() if isinstance(out, torch.Tensor) else 0
        placed = set()
        for arg in node.all_input_nodes:
            dim = rows(arg)
            if dim is None:
                continue
            if not isinstance(dim, int):
                raise self.refuse(node, "takes a tiled sequence where elementwise tensors are expected")
            placed.add(ndim - (_ndim(arg) - dim))
        if len(placed) > 1:
            raise self.refuse(node, f"broadcasts tiled inputs against each other along dims {sorted(placed)}")
        if writes_in_place(node) and placed and rows(node.args[0]) is None:
            raise self.refuse(node, "writes tiled values into an untiled tensor in place")
        return placed.pop() if placed else None

    def reduction(self, node, rows):
        dim = rows(node.args[0])
        if dim is None:
            return None
        ndim = _ndim(node.args[0])
        position = 2 if callable_name(node) == "norm" else 1  # norm(input, p, dim)
        reduced = node.kwargs.get("dim", node.args[position] if len(node.args) > position else None)
        if isinstance(reduced, torch.fx.Node) and isinstance(_value(reduced), torch.Tensor):
            return self.elementwise(node, rows)  # max(a, b), min(a, b): elementwise
        if reduced is None or (isinstance(reduced, (tuple, list)) and len(reduced) == 0):
            raise self.refuse(node, "reduces over every dim, the tile dim included")
        reduced = {_norm(d, ndim) for d in (reduced if isinstance(reduced, (tuple, list)) else (reduced,))}
        if dim in reduced:
            raise self.refuse(node, f"reduces over the tile dim {dim}")
        out = _value(node)
        if isinstance(out, tuple):  # max/min with a dim: (values, indices)
            out = out[0]
        if out.dim() == ndim:  # keepdim, or an op keeping the shape (softmax, cumsum)
            result = dim
        else:
            result = dim - sum(1 for d in reduced if d < dim)
        return (result, result) if isinstance(_value(node), tuple) else result

    def linear(self, node, rows):
        weights = [arg for arg in node.all_input_nodes[1:] if rows(arg) is not None]
        if weights:
            raise self.refuse(node, "computes its weights from the tiles")
        dim = rows(node.args[0])
        if dim is not None and dim == _ndim(node.args[0]) - 1:
            raise self.refuse(node, "contracts over the tile dim")
        return dim

    def matmul(self, node, rows):
        left, right = node.args[0], node.args[1]
        out_ndim = _value(node).dim()
        placed = set()
        for arg, contracted in ((left, -1), (right, -2)):
            dim = rows(arg)
            if dim is None:
                continue
            ndim = _ndim(arg)
            if ndim == 1 or dim == ndim + contracted:
                raise self.refuse(node, "contracts over the tile dim")
            placed.add(out_ndim - (ndim - dim))
        if len(placed) > 1:
            raise self.refuse(node, "multiplies one tile's rows with another tile's columns")
        return placed.pop() if placed else None

    def einsum(self, node, rows):
        equation = node.args[0].replace(" ", "")
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
            operands = operands[0]
        if "..." in equation or "->" not in equation:
            if any(rows(arg) is not None for arg in operands):
                raise self.refuse(node, "has an implicit or ellipsis equation vgraph does not analyze")
            return None
        inputs, output = equation.split("->")
        letters = {inputs.split(",")[i][rows(arg)] for i, arg in enumerate(operands) if rows(arg) is not None}
        if not letters:
            return None
        if len(letters) > 1 or next(iter(letters)) not in output:
            raise self.refuse(node, f"sums over or pairs up tile dims {sorted(letters)}")
        return output.index(next(iter(letters)))

    def attention(self, node, rows):
        query = node.args[0]
        ndim = _ndim(query)
        placed = set()
        arguments = list(node.args[:4]) + [node.kwargs.get("attn_mask")]
        for arg in arguments:
            if not isinstance(arg, torch.fx.Node) or rows(arg) is None:
                continue
            dim, arg_ndim = rows(arg), _ndim(arg)
            if dim >= arg_ndim - 2:
                raise self.refuse(node, "attends across the tile dim")
            placed.add(ndim - (arg_ndim - dim))
        if len(placed) > 1:
            raise self.refuse(node, "pairs queries of one tile with keys of another")
        return placed.pop() if placed else None

    def multi_head_attention(self, node, rows):
        """``F.multi_head_attention_forward``: query/key/value ``[L, N, E]`` (batch dim 1), masks per batch row."""
        for arg in node.args[:3]:
            if rows(arg) not in (None, 1):
                raise self.refuse(node, "attends across the tile dim")
        for name in ("attn_mask",):
            if isinstance(node.kwargs.get(name), torch.fx.Node) and rows(node.kwargs[name]) is not None:
                raise self.refuse(node, "takes a tiled attention mask vgraph does not analyze")
        mask = node.kwargs.get("key_padding_mask")
        if isinstance(mask, torch.fx.Node) and rows(mask) not in (None, 0):
            raise self.refuse(node, "takes a key padding mask whose tile dim is not 0")
        tiled = any(rows(arg) is not None for arg in node.args[:3]) or (
            isinstance(mask, torch.fx.Node) and rows(mask) is not None
        )
        return (1, 0) if tiled else (None, None)

    def layer_norm(self, node, rows):
        dim = rows(node.args[0])
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        normalized = len(shape) if isinstance(shape, (tuple, list)) else 1
        if dim is not None and dim >= _ndim(node.args[0]) - normalized:
            raise self.refuse(node, "normalizes over the tile dim")
        return self.linear(node, rows)

    def per_sample(self, node, rows):
        """Ops over ``[N, C, ...]`` that treat each sample alone (convolution, group norm, interpolate, pad)."""
        if any(rows(arg) is not None for arg in node.all_input_nodes[1:]):
            raise self.refuse(node, "computes its weights from the tiles")
        dim = rows(node.args[0])
        if dim not in (None, 0):
            raise self.refuse(node, f"treats dim 0 as the samples, but the tiles are in dim {dim}")
        return dim

    def batch_norm(self, node, rows):
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        if rows(node.args[0]) is not None and training:
            raise self.refuse(node, "normalizes with batch statistics (training mode)")
        return self.per_sample(node, rows)

    def pad(self, node, rows):
        dim = rows(node.args[0])
        padding = node.args[1] if len(node.args) > 1 else node.kwargs["pad"]
        ndim = _ndim(node.args[0])
        if dim is not None and len(padding) > 2 * (ndim - 1 - dim) and any(padding[2 * (ndim - 1 - dim) :][:2]):
            raise self.refuse(node, "pads the tile dim")
        return dim

    def creation(self, node, rows):
        return None

    def reshape(self, node, rows):
        """The tile dim kept as a dim (``[N, L, D] -> [N, L*D]``) or merged as the outer factor of one
        (``[N, L, D] -> [N*L, D]``, ``Merged``), and back: the elements before it, and the tiles' order, unchanged."""
        source = node.args[0]
        row = rows(source)
        if row is None:
            return None
        dim = row.dim if isinstance(row, Merged) else row
        before, after = _value(source).shape, _value(node).shape
        prefix = math.prod(before[:dim]) if dim else 1
        for out_dim in range(len(after)):
            if not self.same_size(math.prod(after[:out_dim]) if out_dim else 1, prefix):
                continue
            per_tile = sympy.simplify(self.simplify(after[out_dim]) / self.tiles)
            if per_tile == 1:
                return out_dim
            if per_tile.is_Integer and per_tile > 1:
                return Merged(out_dim)
        raise self.refuse(node, f"splits the tile dim ({tuple(before)} -> {tuple(after)})")

    def permute(self, node, rows):
        dim = rows(node.args[0])
        if dim is None:
            return None
        ndim = _ndim(node.args[0])
        name = callable_name(node)
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = (_norm(d, ndim) for d in node.args[1:3])
            return b if dim == a else a if dim == b else dim
        if name in ("movedim", "moveaxis"):
            order = list(range(ndim))
            source, destination = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
            order.insert(destination, order.pop(source))
            return order.index(dim)
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if name == "t":
            order = (1, 0) if ndim == 2 else (0,)
        return [_norm(d, ndim) for d in order].index(dim)

    def unsqueeze(self, node, rows):
        dim = rows(node.args[0])
        if dim is None:
            return None
        inserted = _norm(node.args[1], _ndim(node.args[0]) + 1)
        return dim + 1 if inserted <= dim else dim

    def squeeze(self, node, rows):
        dim = rows(node.args[0])
        if dim is None:
            return None
        ndim = _ndim(node.args[0])
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None:
            raise self.refuse(node, "squeezes every size-1 dim (the tile dim too, for one tile)")
        dims = {_norm(d, ndim) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))}
        if dim in dims:
            raise self.refuse(node, "squeezes the tile dim")
        return dim - sum(1 for d in dims if d < dim)

    def expand(self, node, rows):
        dim = rows(node.args[0])
        if dim is None:
            return None
        ndim, out = _ndim(node.args[0]), _value(node)
        placed = out.dim() - (ndim - dim)
        if callable_name(node) == "repeat":
            counts = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
            if _value(counts[placed]) != 1:
                raise self.refuse(node, "repeats the tile dim")
        return placed

    def getitem(self, node, rows):
        source, index = node.args
        dim = rows(source)
        if isinstance(dim, tuple):
            return dim[index]
        if dim is None or not isinstance(_value(source), torch.Tensor):
            return None
        ndim = _ndim(source)
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(item, torch.fx.Node) and isinstance(_value(item), torch.Tensor) for item in index):
            return self.gather(node, index, dim, rows)
        specified = sum(1 for item in index if item is not None and item is not Ellipsis)
        position, out_dim = 0, 0
        for item in index:
            if item is Ellipsis:
                skipped = ndim - specified
                if position <= dim < position + skipped:
                    return out_dim + dim - position
                position, out_dim = position + skipped, out_dim + skipped
            elif item is None:
                out_dim += 1
            elif isinstance(item, slice):
                if position == dim:
                    if item != slice(None, None, None):
                        raise self.refuse(node, "slices the tile dim")
                    return out_dim
                position, out_dim = position + 1, out_dim + 1
            else:
                if position == dim:
                    raise self.refuse(node, "picks one tile")
                position += 1
        return out_dim + dim - position

    def gather(self, node, index, dim, rows):
        """``x[..., i, ...]`` with tensor indices: the tile dim's index must be ``arange(N)`` (possibly viewed,
        unsqueezed or expanded: ``self.iota``) and no other index tiled, so output row i reads tile i only."""
        if self.merged:
            raise self.refuse(node, "indexes a merged tile dim with a tensor")
        if any(item is Ellipsis or item is None for item in index):
            raise self.refuse(node, "indexes with a tensor and None/Ellipsis, which vgraph does not analyze")
        tensors = [p for p, item in enumerate(index) if isinstance(item, torch.fx.Node) and _is_tensor(item)]
        if dim >= len(index) or dim not in tensors or self.iota.get(index[dim]) is None:
            raise self.refuse(node, "indexes the tiles with a tensor other than arange(N) (gathers rows)")
        if any(rows(index[p]) is not None for p in tensors):
            raise self.refuse(node, "indexes with a tensor computed from the tiles")
        broadcast = max(_ndim(index[p]) for p in tensors)
        landed = broadcast - (_ndim(index[dim]) - self.iota[index[dim]])
        adjacent = tensors == list(range(tensors[0], tensors[-1] + 1))
        return (tensors[0] if adjacent else 0) + landed

    def join(self, node, rows):
        """cat / stack: tensors joined along a dim other than the tile dim."""
        tensors = node.args[0]
        ndim = _ndim(tensors[0])
        joined = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        joined = _norm(joined, ndim + (callable_name(node) == "stack"))
        dims = {rows(arg) for arg in tensors if isinstance(arg, torch.fx.Node)} - {None}
        if len(dims) > 1:
            raise self.refuse(node, f"joins tensors whose tiles are in different dims {sorted(dims)}")
        if not dims:
            return None
        dim = dims.pop()
        if callable_name(node) == "stack":
            return dim + 1 if joined <= dim else dim
        if joined == dim:
            raise self.refuse(node, "concatenates along the tile dim")
        return dim

    def split(self, node, rows):
        dim = rows(node.args[0])
        pieces = _value(node)
        if dim is None:
            return tuple(None for _ in pieces)
        name = callable_name(node)
        along = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        if name == "unbind":
            along = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        along = _norm(along, _ndim(node.args[0]))
        if along == dim:
            raise self.refuse(node, "splits the tile dim")
        return tuple(dim - (name == "unbind" and along < dim) for _ in pieces)

    def narrow(self, node, rows):
        dim = rows(node.args[0])
        if dim is not None and _norm(node.args[1], _ndim(node.args[0])) == dim:
            raise self.refuse(node, "narrows the tile dim")
        return dim

    def setitem(self, node, rows):
        target, index, value = node.args
        if rows(target) is None and isinstance(value, torch.fx.Node) and rows(value) is not None:
            raise self.refuse(node, "writes tiled values into an untiled tensor")
        if rows(target) is not None:
            self.getitem(node, lambda arg: rows(arg) if arg is not node else None)
        return None


_ELEMENTWISE = (
    "add sub mul truediv floordiv div mod pow neg abs exp log log1p sqrt rsqrt reciprocal square tanh sigmoid "
    "gelu silu relu relu6 leaky_relu elu selu celu hardswish hardsigmoid mish softplus erf sin cos clamp clip "
    "where masked_fill dropout to type float half bfloat16 double long int bool contiguous clone detach type_as "
    "eq ne lt le gt ge and_ or_ xor invert logical_not logical_and logical_or maximum minimum sign floor ceil round "
    "bucketize nan_to_num lerp addcmul addcdiv sub_ add_ mul_ div_ clamp_ masked_fill_ iadd imul isub itruediv "
    "quick_gelu fast_gelu"
).split()
_REDUCTIONS = (
    "sum mean amax amin max min var std norm prod logsumexp all any argmax argmin softmax log_softmax cumsum cumprod"
).split()
_CREATION = (
    "arange ones zeros full empty tensor new_ones new_zeros new_full new_empty new_tensor ones_like zeros_like "
    "full_like empty_like rand randn linspace eye size dim numel _assert _check"
).split()
_TABLE: dict[str, str] = {
    **{name: "elementwise" for name in _ELEMENTWISE},
    **{name: "reduction" for name in _REDUCTIONS},
    **{name: "creation" for name in _CREATION},
    **dict(linear="linear", embedding="linear_embedding", matmul="matmul", bmm="matmul", mm="matmul"),
    **dict(einsum="einsum", scaled_dot_product_attention="attention"),
    **dict(multi_head_attention_forward="multi_head_attention", layer_norm="layer_norm", rms_norm="layer_norm"),
    **{name: "per_sample" for name in "conv1d conv2d conv3d group_norm instance_norm interpolate".split()},
    **dict(batch_norm="batch_norm", pad="pad"),
    **{name: "reshape" for name in "view reshape reshape_as view_as flatten unflatten".split()},
    **{name: "permute" for name in "transpose swapaxes swapdims permute movedim moveaxis t".split()},
    **dict(unsqueeze="unsqueeze", squeeze="squeeze", expand="expand", expand_as="expand", repeat="expand"),
    **dict(getitem="getitem", setitem="setitem", cat="join", concat="join", concatenate="join", stack="join"),
    **{name: "split" for name in "split chunk unbind tensor_split".split()},
    **dict(narrow="narrow"),
}
"""Op name (``callable_name``) -> the rule that gives its output's row dim."""


_IOTA_VIEWS = ("view", "reshape", "unsqueeze", "expand", "getitem", "to", "long", "int", "contiguous")


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(example_value(node), torch.Tensor)


def _embedding(rules: _Rules, node, rows):
    """``F.embedding(ids, table)``: the ids' tile dim, the table untiled."""
    if rows(node.args[1]) is not None:
        raise rules.refuse(node, "looks up a table computed from the tiles")
    return rows(node.args[0])


def row_dims(
    gm: torch.fx.GraphModule, tiled: dict[torch.fx.Node, int], simplify, tiles: sympy.Expr
) -> dict[torch.fx.Node, RowDim]:
    """The row dim of every node, from the tiled inputs' (``tiled``); raises ``TileMixingError`` on a mix."""
    rules = _Rules(simplify, tiles)
    found: dict[torch.fx.Node, RowDim] = {}

    def rows(arg: Any) -> RowDim:
        return found.get(arg) if isinstance(arg, torch.fx.Node) else None

    def plain_rows(arg: Any) -> RowDim:
        return _unwrap(rows(arg))

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            found[node] = tiled.get(node)
        elif node.op in ("get_attr", "output"):
            found[node] = None
        elif node.op in ("call_function", "call_method", "call_module"):
            name = callable_name(node) if node.op != "call_module" else str(node.target)
            if _reads_tile_count(node, tiles):
                raise rules.refuse(node, "computes values from the tile count N (a bucket's N differs from the call's)")
            kinds = set().union(*(_kinds(rows(arg)) for arg in node.all_input_nodes))
            if not kinds:
                found[node] = _untiled(node)
                rules.track_iota(node)
                continue
            if node.target is operator.getitem:
                name = "getitem"
            rule = _TABLE.get(name)
            if rule is None:
                raise rules.refuse(node, "is an op vgraph cannot prove keeps tiles apart (no rule for it)")
            if kinds == {int} or rule == "reshape":
                rules.merged = False
                found[node] = _apply(rules, rule, node, rows)
            elif kinds == {Merged}:
                rules.merged = True
                found[node] = _wrap(_apply(rules, rule, node, plain_rows))
            else:
                raise rules.refuse(node, "combines tensors whose tiles are a dim with tensors whose tiles are merged")
    return found


def _apply(rules: _Rules, rule: str, node: torch.fx.Node, rows) -> RowDim:
    if rule == "linear_embedding":
        return _embedding(rules, node, rows)
    return getattr(rules, rule)(node, rows)


_SIZE_ARGUMENTS = frozenset(
    "view reshape expand repeat flatten unflatten narrow split chunk tensor_split interpolate new_zeros new_ones "
    "new_empty zeros ones empty _check _assert size".split()
)
"""Ops whose integer arguments are sizes: the tile count may reach them (a bucket's graph has its own N)."""
_VALUE_ARGUMENTS = {"full": ("fill_value", 1), "new_full": ("fill_value", 2), "arange": None}
"""Ops that take sizes and values: the argument holding a value (name, position); ``arange``: every argument but
the end."""


def _reads_tile_count(node: torch.fx.Node, tiles: sympy.Expr) -> bool:
    """Whether a tensor op uses a value computed from the tile count N (``x / x.shape[0]``): in a bucket N is the
    bucket's, so such a value would differ from the call's. Sizes (reshape, expand, arange's end) may use N."""
    if not isinstance(example_value(node), torch.Tensor):
        return False
    name = callable_name(node)
    if name in _SIZE_ARGUMENTS:
        return False

    def counts(arg: Any) -> bool:
        value = _value(arg)
        symbolic = isinstance(value, (torch.SymInt, torch.SymFloat))
        return symbolic and bool(tiles.free_symbols & value.node.expr.free_symbols)

    if name == "arange":
        positional = node.args if len(node.args) != 1 else ()
        values = [positional[0]] if positional else []
        values += list(positional[2:]) + [node.kwargs.get("start"), node.kwargs.get("step")]
    elif name in _VALUE_ARGUMENTS:
        keyword, position = _VALUE_ARGUMENTS[name]
        values = [node.kwargs.get(keyword, node.args[position] if len(node.args) > position else None)]
    else:
        values = list(node.args) + list(node.kwargs.values())
    flat = [item for value in values for item in (value if isinstance(value, (tuple, list)) else (value,))]
    return any(counts(item) for item in flat)


def _untiled(node: torch.fx.Node) -> RowDim:
    value = example_value(node)
    return tuple(None for _ in value) if isinstance(value, (tuple, list)) else None


def _reachable_budgets(ctx: PassContext, tiles: sympy.Expr, simplify) -> "VGraphConfig":
    """The config without the tile counts the trace's guards on N alone exclude: a call of such a count pads to
    the next bucket (``hf/whole_graph/tiles`` gives one tile a static graph of its own instead). Each excluded count is
    recorded in ``ctx.dropped`` with the guard and its op, and counted. The one known case: SigLIP's MAP head calls
    ``F.multi_head_attention_forward``, whose key projection is a linear of a transposed ``[L, N, E]`` view;
    ``at::native::linear`` asks whether that view is contiguous, and with every size hinted c10's contiguity
    check compares each size with 1 through a guard (not size-obliviously), so the trace guards ``N != 1``."""
    guards = [(simplify(guard.expr), guard) for guard in ctx.shape_env.guards]
    guards = [(expr, guard) for expr, guard in guards if expr.free_symbols == tiles.free_symbols]
    kept = []
    for budget in ctx.config.budgets:
        failed = [(expr, guard) for expr, guard in guards if expr.xreplace({tiles: budget}) == sympy.false]
        if not failed:
            kept.append(budget)
            continue
        reason = "; ".join(
            f"the trace's guard {expr.xreplace({tiles: sympy.Symbol('N')})} on the tile count N fails there (from "
            f"{guard_origin(guard)})"
            for expr, guard in failed
        )
        ctx.dropped.append(DroppedBucket(budget, reason))
        counters.buckets_dropped += 1
        log.warning("tile count %d dropped: %s", budget, reason)
    if not kept:
        raise ValueError(
            f"the trace's guards {[expr for expr, _ in guards]} exclude every tile budget {list(ctx.config.budgets)}"
        )
    return dataclasses.replace(ctx.config, token_budgets=tuple(kept))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    check_no_host_sync(gm)
    simplify = simplifier(ctx.shape_env)
    inputs = graph_inputs(gm, ctx)
    if ctx.config.static_rows:
        tiles = _static_tiles(gm, ctx, inputs, simplify)
    else:
        tiles = _dynamic_tiles(gm, ctx, inputs, simplify)
    features = feature_sizes(inputs, simplify, ctx.shape_env)
    sizes = input_sizes(inputs, simplify)
    roles = other_roles(inputs, {}, simplify)
    ctx.spec = VarlenSpec(
        inputs=tuple(roles[index] for index in range(len(inputs.nodes))),
        sites=(),
        groups=(),
        token_rows=tiles,
        bindings=sizes.bindings,
        input_shapes=sizes.shapes,
        outputs=output_shapes(gm, simplify),
        features=features,
        relations={},
    )
    log.debug("tile spec:\n%s", ctx.spec.format())
    return gm


def _dynamic_tiles(gm: torch.fx.GraphModule, ctx: PassContext, inputs, simplify) -> sympy.Expr:
    """The tile count N of a trace dynamic in it, once the rows are proven independent; ``ctx.config`` loses the
    counts the trace's guards exclude."""
    tiles, tiled = None, {}
    for index, node in enumerate(inputs.nodes):
        value = example_value(node)
        if index in inputs.parameters or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        rows = simplify(value.shape[0])
        if not rows.free_symbols:
            continue
        if tiles is None:
            tiles = rows
        elif sympy.simplify(rows - tiles) != 0:
            raise ValueError(
                f"input {inputs.name(index)!r} has {rows} rows in dim 0 but the first tiled input has {tiles}: "
                "every per-tile input of a fixed-tile tower has one row per tile"
            )
        tiled[node] = 0
    if tiles is None:
        raise ValueError(
            "the traced tower has no input whose dim 0 varies: trace it with dynamic=True (vgraph_compile.encoder "
            "does) so the tile count N is symbolic"
        )
    found = row_dims(gm, tiled, simplify, tiles)
    for position, arg, value in _tensor_outputs(gm):
        if found.get(arg) not in (0, None) or sympy.simplify(simplify(value.shape[0]) - tiles) != 0:
            raise TileMixingError(
                f"output {position} ({arg.format_node()}, shape {tuple(value.shape)}) does not have "
                f"the tiles ({tiles}) in dim 0 (its tile dim: {found.get(arg)}): vgraph narrows outputs to the "
                "real tiles along dim 0"
            )
    ctx.config = _reachable_budgets(ctx, tiles, simplify)
    log.info("proved the rows of %s tiled inputs independent", len(tiled))
    return tiles


def _static_tiles(gm: torch.fx.GraphModule, ctx: PassContext, inputs, simplify) -> sympy.Expr:
    """The tile count of a static trace (``VGraphConfig.static_rows``): its one budget, which the per-tile inputs
    have in dim 0 (at least one) and every tensor output too. Its calls have exactly that many tiles, so no padding
    row exists and no proof of independent rows is needed here (the dynamic trace of the same tower gave it, for
    the split of a long call)."""
    (budget,) = ctx.config.budgets
    rows = [
        simplify(example_value(node).shape[0])
        for index, node in enumerate(inputs.nodes)
        if index not in inputs.parameters
        and isinstance(example_value(node), torch.Tensor)
        and example_value(node).dim() > 0
    ]
    if budget not in rows:
        raise ValueError(
            f"no input of the static trace has {budget} rows in dim 0 (its inputs have {rows}): trace it on a call "
            "of exactly token_budgets[0] tiles, with dim 0 static"
        )
    for position, arg, value in _tensor_outputs(gm):
        if simplify(value.shape[0]) != budget:
            raise TileMixingError(
                f"output {position} ({arg.format_node()}, shape {tuple(value.shape)}) does not have the {budget} "
                "tiles in dim 0: vgraph narrows outputs to the real tiles along dim 0"
            )
    return sympy.Integer(budget)


def _tensor_outputs(gm: torch.fx.GraphModule):
    """(position, node, example value) of each tensor output."""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for position, arg in enumerate(values):
        if isinstance(arg, torch.fx.Node) and isinstance(example_value(arg), torch.Tensor):
            yield position, arg, example_value(arg)
