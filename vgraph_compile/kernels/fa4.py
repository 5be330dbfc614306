"""FlashAttention-4: the CuTe-DSL varlen forward of ``flash-attn-4`` (``pip install vgraph_compile[fa4]``, which
brings ``nvidia-cutlass-dsl``; CUDA sm90+, fp16/bf16, head_dim a multiple of 8 up to 128, which sm90 and sm100
both run; the op pads other head dims).

Invariants:
- the first call of a shape JIT-compiles the kernel (seconds, cached per process), so it belongs to the warm-up
  before capture; a capture only launches compiled kernels;
- ``max_seqlen`` is the bucket's host bound, which the kernel takes as the bound of every replay;
- the kernel loads whole key tiles, rows of the next segment or of the padding included, and masks their scores;
  a masked weight times a NaN value is still NaN, so it runs ``segments.confined`` (as the masked kernels do): a
  NaN/Inf in one segment reaches no other, at the cost of one pass over k and v (``auto`` times it included);
- zero-length segments (padding that repeats the last offset) are empty, and rows past ``cu_seqlens[-1]`` are left
  for the op to zero;
- its compiled kernels are saved on disk beside inductor's cache (flash-attn-4's own persistent cache,
  ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`` / ``_DIR``, set here unless the user set them before flash-attn-4 was
  first imported), so a warm start loads them instead of compiling them again.
"""

from __future__ import annotations

import functools
import os

import torch

from vgraph_compile.kernels.segments import confined


def unconfined(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
) -> torch.Tensor:
    """The kernel alone: a NaN/Inf in k or v can reach the rows of the previous segment."""
    out, _ = _varlen_forward()(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
    )
    return out


attention = confined(unconfined)


@functools.cache
def _varlen_forward():
    """flash-attn-4's varlen forward, imported once, its JIT cache on disk (module docstring)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", os.path.join(cache_dir(), "flash_attention_cute_dsl"))
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func
