"""FlexAttention (``torch.nn.attention.flex_attention``) with a document mask from the padded ``cu_seqlens``.

The ``BlockMask`` is built on the device from the offsets at every call, inside the same compiled function as the
attention, so nothing is built on the host and nothing goes stale across CUDA graph replays:

- the segment id of every row comes from ``searchsorted`` on the offsets (rows past ``cu_seqlens[-1]`` form a
  block of their own, so no row is fully masked);
- a 128x128 tile is *full* when its query and key rows all lie in one segment, *partial* when their segment ranges
  overlap otherwise, and skipped when they do not overlap: O((rows/128)^2) work from the first and last segment id
  of each tile, never the dense ``rows x rows`` mask ``create_block_mask`` would evaluate;
- ``BlockMask.from_kv_blocks`` (public in torch >= 2.5) takes the tiles, ordered with a stable device sort, and the
  ``mask_mod`` compares segment ids inside partial tiles. Its query-side tiles (``compute_q_blocks``) serve only
  the backward pass and are skipped: their ``vmap`` fails when the op runs under AOT autograd's runtime modes.

The mask is built by plain device ops (captured with the rest of a bucket's graph). On CUDA ``flex_attention``
itself runs through ``torch.compile`` (one Triton kernel, dynamic in the rows; the first call of a head dim and
dtype compiles, so it belongs to the warm-up run before capture; later calls with other rows or offsets reuse it).
Compiling the mask's construction together with the kernel gave wrong rows on an H200 (torch 2.11: a 7-row segment
straddling a tile edge next to the padding block) although the tiles equal ``create_block_mask``'s; built outside,
the same mask gives the exact result. On the CPU everything runs eagerly: torch 2.11-2.13's CPU flex template fails
to lower a ``mask_mod`` that reads a captured tensor, and the eager path is the exact unfused computation. A masked
tile still multiplies masked values by a zero weight, so the kernel runs ``segments.confined``: a NaN/Inf in one
segment reaches no other. Its queries are confined too: in bf16, flex spreads a NaN in one query row to other rows
of its head (measured on the CPU, torch 2.11-2.13, and seen as a failed isolation test on an H200).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from vgraph_compile.kernels.segments import confined, segment_ids

TILE = 128
"""Rows per BlockMask tile (FlexAttention's default block size)."""


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's ``(num_blocks, indices)`` for a ``[q_tiles, kv_tiles]`` bool matrix: the set tiles first."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def document_mask(ids: torch.Tensor) -> BlockMask:
    """The BlockMask of ``ids[q] == ids[kv]`` for non-decreasing segment ids, built on the device."""
    rows = ids.shape[0]
    starts = torch.arange(0, rows, TILE, device=ids.device)
    first, last = ids[starts], ids[(starts + TILE - 1).clamp(max=rows - 1)]
    overlap = torch.maximum(first[:, None], first[None]) <= torch.minimum(last[:, None], last[None])
    single = (first == last) & (starts + TILE <= rows)
    full = single[:, None] & single[None] & (first[:, None] == first[None])

    def same_segment(batch, head, q_index, kv_index):
        return ids[q_index] == ids[kv_index]

    return BlockMask.from_kv_blocks(
        *_ordered(overlap & ~full),
        *_ordered(full),
        BLOCK_SIZE=TILE,
        mask_mod=same_segment,
        seq_lengths=(rows, rows),
        compute_q_blocks=False,
    )


def _attend(q, k, v, cu_seqlens, scale, kernel):
    ids = segment_ids(cu_seqlens, q.shape[0])
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out = kernel(*heads_first, block_mask=document_mask(ids), scale=scale)
    return out[0].transpose(0, 1)


RECOMPILE_LIMIT = 64
"""Compiles of ``flex_attention`` a process may hold (dynamo's default is 8): one per head dim, dtype, scale and
dispatch state (``opcheck``'s modes among them), each dynamic in the rows; under ``fullgraph=True`` one past the
limit is an error, not a fallback (on an H200, ``opcheck`` after the kernel tests' head dims and dtypes hit 8)."""


@functools.cache
def _compiled_flex_attention():
    """``flex_attention`` compiled once per specialization, dynamic in the rows (``dynamic=True``)."""
    return torch.compile(flex_attention, fullgraph=True, dynamic=True)


def _compiled_attend(q, k, v, cu_seqlens, scale):
    """``_attend`` through the compiled kernel, under a recompile limit of at least ``RECOMPILE_LIMIT``."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    with torch._dynamo.config.patch(recompile_limit=limit):
        return _attend(q, k, v, cu_seqlens, scale, _compiled_flex_attention())


def unconfined(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    """The masked kernel alone: a NaN/Inf in k or v reaches other segments."""
    with _functorch_enabled():
        if q.device.type != "cpu":
            return _compiled_attend(q, k, v, cu_seqlens, scale)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
            return _attend(q, k, v, cu_seqlens, scale, flex_attention)


attention = confined(unconfined, queries=True)


_FUNCTORCH_KEYS = [
    getattr(torch._C.DispatchKey, key)
    for key in (
        "FuncTorchDynamicLayerFrontMode",
        "FuncTorchDynamicLayerBackMode",
        "FuncTorchBatched",
        "FuncTorchVmapMode",
        "FuncTorchGradWrapper",
        "PythonTLSSnapshot",
    )
]


def _functorch_enabled():
    """A compiled graph calls custom ops with functorch's dispatch keys excluded (they run below autograd); eager
    flex evaluates ``mask_mod`` under ``vmap``, which needs them, and so may flex's first compile. Re-admit them for
    the kernel only."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _FUNCTORCH_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
