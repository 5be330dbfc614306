"""Rewrite: an attention mask that is all True by construction is dropped from its ``scaled_dot_product_attention``.

Under tracing, transformers keeps the all-True mask it skips in eager (``_ignore_bidirectional_mask_sdpa`` cannot
read the values of a traced mask): Idefics3's SigLIP builds ``torch.ones`` for a call without
``patch_attention_mask`` and expands it to ``[N, 1, L, L]``. SDPA then runs its masked kernel (memory-efficient
attention reading an ``N * L * L`` bias: 2.9x cuDNN's unmasked time per layer at 13 tiles of 729 tokens on an H200,
``benchmarks/results/tile_attention_h200.json``) where eager runs the unmasked one.

Invariant: a mask is dropped only when every element is True whatever the inputs: it is computed from constants
alone by the ops below, each of which keeps "every element True" (or "every element non-negative", for index
ranges compared with ``>= 0``). A boolean mask of all True masks nothing, so the attention is unchanged.

Cases handled (values proven from creation ops, through views, casts, indexing and ``&``):
- ``torch.ones``, ``new_ones``, ``ones_like``, ``full``/``new_full`` of 1 or True: every element one;
- ``arange`` from a non-negative start, plus a non-negative constant: every element non-negative; ``x >= 0`` of it
  is all True;
- views, expands, casts, copies and indexing (``x[i, j]`` reads elements of ``x``) keep what ``x`` has; ``a & b``
  and ``a * b`` are all True/one when both are.

Before/After::

    mask = torch.ones((s77, 4, 4)).to(dtype=torch.bool)          (the mask's ops, now unused, are removed)
    m = ge(arange(16) + 0, 0) & mask.view(s77, -1)[b, kv]
    attn = scaled_dot_product_attention(q, k, v, attn_mask=m)    attn = scaled_dot_product_attention(q, k, v)
"""

from __future__ import annotations

import enum
import logging

import torch
import torch.fx

from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import callable_name, example_value
from vgraph_compile.spec import PassContext

__all__ = ["run", "true_masks"]

log = logging.getLogger(__name__)


class _Known(enum.Enum):
    ONES = "every element is one (True)"
    NON_NEGATIVE = "every element is >= 0"


_ONES_CREATION = frozenset({"ones", "new_ones", "ones_like"})
_FULL = {"full": 1, "new_full": 2}
"""Creation by fill value: the positional index of ``fill_value``."""
_VIEWS = frozenset({
    "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "permute", "transpose",
    "contiguous", "clone", "getitem", "select", "narrow", "index_select", "repeat", "detach",
})  # fmt: skip
"""Ops whose result holds only elements of their first argument: they keep ONES and NON_NEGATIVE."""
_CASTS = frozenset({"to", "bool", "float", "long", "int", "type_as"})
"""Casts keep ONES (1 and True cast to each other); not NON_NEGATIVE (a narrow integer type can wrap)."""
_BOTH = frozenset({"and_", "iand", "logical_and", "mul", "bitwise_and"})
_SDPA = "scaled_dot_product_attention"


def _known(node: torch.fx.Node, known: dict[torch.fx.Node, _Known]) -> _Known | None:
    if node.op not in ("call_function", "call_method"):
        return None
    name = callable_name(node)
    if name in _ONES_CREATION:
        return _Known.ONES
    if name in _FULL:
        value = node.kwargs.get("fill_value", node.args[_FULL[name]] if len(node.args) > _FULL[name] else None)
        return _Known.ONES if value is True or (type(value) in (int, float) and value == 1) else None
    if name == "arange":
        start = node.args[0] if len(node.args) > 1 else node.kwargs.get("start", 0)
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        numbers = type(start) in (int, float) and type(step) in (int, float)
        return _Known.NON_NEGATIVE if numbers and start >= 0 and step > 0 else None
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    if name in _VIEWS:
        return known.get(first)
    if name in _CASTS:
        return _Known.ONES if known.get(first) is _Known.ONES else None
    second = node.args[1] if len(node.args) > 1 else None
    if name == "add" and known.get(first) is _Known.NON_NEGATIVE and type(second) is int and second >= 0:
        return _Known.NON_NEGATIVE
    if name == "ge" and known.get(first) is _Known.NON_NEGATIVE and type(second) in (int, float) and second <= 0:
        return _Known.ONES
    if name in _BOTH and isinstance(second, torch.fx.Node):
        if known.get(first) is _Known.ONES and known.get(second) is _Known.ONES:
            return _Known.ONES
    return None


def _mask_argument(node: torch.fx.Node) -> tuple[str | int, torch.fx.Node] | None:
    """Where an SDPA call takes its mask (keyword or the fourth positional argument), and the mask node."""
    if "attn_mask" in node.kwargs:
        mask = node.kwargs["attn_mask"]
        return ("attn_mask", mask) if isinstance(mask, torch.fx.Node) else None
    if len(node.args) > 3 and isinstance(node.args[3], torch.fx.Node):
        return 3, node.args[3]
    return None


def true_masks(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The SDPA calls whose mask is boolean and all True by construction, in graph order."""
    known: dict[torch.fx.Node, _Known] = {}
    found = []
    for node in gm.graph.nodes:
        fact = _known(node, known)
        if fact is not None:
            known[node] = fact
        if node.op == "call_function" and callable_name(node) == _SDPA:
            where = _mask_argument(node)
            if where is not None and known.get(where[1]) is _Known.ONES:
                value = example_value(where[1])
                if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
                    found.append(node)
    return found


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    dropped = true_masks(gm)
    for node in dropped:
        where, _ = _mask_argument(node)
        if where == "attn_mask":
            node.kwargs = {**node.kwargs, "attn_mask": None}
        else:
            node.args = (*node.args[:3], None, *node.args[4:])
        counters.nodes_rewritten += 1
    if dropped:
        gm.graph.eliminate_dead_code()
        log.info("dropped %d attention masks that are all True by construction", len(dropped))
    return gm
