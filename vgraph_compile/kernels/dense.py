"""Dense attention over the whole packed rows as one sequence, by torch's own SDPA kernels (cuDNN, FlashAttention-2,
memory-efficient: all inside torch, no extra package). This is the kernel a stock tower runs on one large image.

A mask would rule out the flash and cuDNN kernels, so segments are kept apart by the scores themselves. Each row
gets an id, its segment (rows past ``cu_seqlens[-1]`` get one id of their own, the padding's), and q and k get
``2 * bits`` extra columns, ``bits`` being the width of the largest id. For bit ``j``, q holds ``C * b_j`` and
``C * (1 - b_j)`` of its row's id, k holds ``-C * (1 - b_j)`` and ``-C * b_j`` of its own. So ``q . k`` gains
``-C^2`` per bit where the two ids differ, and exactly 0 where they are equal (every product is ``C * 0``):

- a pair in one segment scores what it scores without the columns, bit for bit;
- a pair across segments, or with a padding row, scores ``-C^2`` or less (``C^2`` = 2^120 in bf16, 2^30 in fp16,
  still finite in the fp32 accumulator), whose softmax weight is exactly 0 whenever the row's own best score is
  above ``-C^2 * scale + 100``: against the confined (finite) v it adds an exact 0.

Each kernel is the first choice of SDPA's priority list, the memory-efficient kernel and math after it, so a shape
the named kernel cannot run (a call at exact size below every bucket) still runs. The columns take head-dim room: 72
+ 2 columns run at 80 (one segment slot, the padding rows its second id), 72 + 10 at 88 (16 slots). q, k and v are
zero-padded to the width (a multiple of 8) and the columns written into q's and k's padding; the output is sliced
back. (Built by concatenating each row's pieces instead, the copy of q and k took 4.2 of 62 ms of a released
Qwen2-VL call of 9,216 patches on an H200, five times their memory traffic.) The work is quadratic in all the rows,
not per segment (``AttentionBackend.whole_rows``): ``attention_backend="auto"`` gives it only calls whose offsets
hold one segment slot (one image at its exact size, or a bucket of one), where timing says it is fastest, so it
always runs with the two columns.
NaN/Inf isolation is ``segments.confined``'s: a non-finite k/v entry is zeroed for the kernel and its segment's head
comes out NaN; a query row reads only its own q, so q needs no confinement.

The kernels leave SDPA's choice for everyone else as they found it: torch settles its default backend order (cuDNN
first on sm90/sm100 with a recent cuDNN) at a process's first SDPA call, and ``sdpa_kernel(..., set_priority=True)``
entered before that restores the unsettled order, which puts cuDNN last for the rest of the process (on an H200 the
So400m and InternViT tiles' own attention then ran FlashAttention-2, 1.4x cuDNN's time). ``settle_sdpa_order`` makes
that first call before any order is read.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vgraph_compile.kernels.segments import confined, segment_ids

__all__ = ["cudnn", "flash", "efficient", "separation_columns", "settle_sdpa_order", "MAX_WIDTH"]

MAX_WIDTH = 256
"""The widest head dim (with the columns) the dense kernels are asked to run; wider raises (too many segments)."""

_FALLBACKS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""Where the named kernel cannot run a shape (cuDNN refuses a single key row, say): the memory-efficient kernel,
which runs any fp16/bf16 CUDA shape at a multiple-of-8 width, then math (CPU)."""

_SEPARATION = {torch.bfloat16: 2.0**60, torch.float16: 2.0**15, torch.float32: 2.0**60, torch.float64: 2.0**60}


def separation_columns(cu_seqlens: torch.Tensor, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q columns, k columns)``, each ``[rows, 2 * bits]``: their dot product is 0 for two rows of one segment
    (or two padding rows), ``-C^2`` per differing bit of the ids otherwise (module docstring)."""
    ids = segment_ids(cu_seqlens, rows)
    bits = max(1, int(cu_seqlens.shape[0] - 1).bit_length())
    bit = ((ids[:, None] >> torch.arange(bits, device=ids.device)) & 1).to(dtype)
    scale = _SEPARATION[dtype]
    q = torch.stack([bit, 1 - bit], dim=-1).flatten(1) * scale
    k = torch.stack([bit - 1, -bit], dim=-1).flatten(1) * scale
    return q, k


def _widened(t: torch.Tensor, width: int, columns: torch.Tensor | None) -> torch.Tensor:
    """``t`` (``[rows, heads, head_dim]``, any strides) in a new ``[rows, heads, width]`` tensor: its columns, then
    ``columns`` (``[rows, c]``, the same for every head) where given, then zeros. Each entry is written once (one
    copy of ``t``; ``F.pad`` would fill the whole tensor first, then copy ``t`` over it)."""
    rows, heads, head_dim = t.shape
    out = t.new_empty(rows, heads, width)
    out[..., :head_dim] = t
    end = head_dim
    if columns is not None:
        end += columns.shape[1]
        out[..., head_dim:end] = columns[:, None, :]
    if end < width:
        out[..., end:] = 0
    return out


@functools.cache
def settle_sdpa_order(device_type: str) -> None:
    """Make torch settle its default SDPA backend order (module docstring) with one tiny SDPA call on a device of
    ``device_type``, once per process, before any ``sdpa_kernel`` reads the order."""
    if device_type == "cuda":
        q = torch.zeros(1, 1, 1, 8, device=device_type, dtype=torch.float16)
        F.scaled_dot_product_attention(q, q, q)


def _dense(backend: SDPBackend):
    def unconfined(q, k, v, cu_seqlens, max_seqlen, scale):
        settle_sdpa_order(q.device.type)
        rows, heads, head_dim = q.shape
        q_columns, k_columns = separation_columns(cu_seqlens, rows, q.dtype)
        width = -(-(head_dim + q_columns.shape[1]) // 8) * 8
        if width > MAX_WIDTH:
            raise ValueError(
                f"dense attention needs head_dim {head_dim} plus {q_columns.shape[1]} separation columns "
                f"(<= {MAX_WIDTH}): too many segments ({cu_seqlens.shape[0] - 1}) for one dense call"
            )
        q, k, v = (_widened(t, width, columns) for t, columns in ((q, q_columns), (k, k_columns), (v, None)))
        scale = head_dim**-0.5 if scale is None else scale
        with sdpa_kernel([backend, *_FALLBACKS], set_priority=True):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
            )
        return out[0].transpose(0, 1)[..., :head_dim]

    return confined(unconfined)


cudnn = _dense(SDPBackend.CUDNN_ATTENTION)
"""cuDNN's fused flash kernel through torch's SDPA (what the stock towers get on sm90)."""
flash = _dense(SDPBackend.FLASH_ATTENTION)
"""torch's FlashAttention-2 through SDPA (on the CPU: its CPU flash kernel)."""
efficient = _dense(SDPBackend.EFFICIENT_ATTENTION)
"""torch's memory-efficient (CUTLASS) kernel through SDPA."""
