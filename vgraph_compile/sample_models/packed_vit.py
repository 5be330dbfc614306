"""``PackedViT``: a small ViT over packed variable-length patch sequences, the shape of a VLM vision tower.

``forward(patches [N, patch_dim], cu_seqlens int32 [S + 1], max_seqlen int) -> [N / merge, out_dim]``: a linear
patch embedding, pre-norm blocks with ``vgraph_compile.varlen_attention`` (each image attends to itself only), a
final norm and a merger that concatenates ``merge`` consecutive tokens (Qwen's 2x2 spatial merge when 4).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vgraph_compile.kernels import segments
from vgraph_compile.kernels.ops import varlen_attention

__all__ = ["PackedViT", "WindowedViT", "ClsViT", "PlacedClsViT", "RegisterViT", "pack_images", "place_cls_rows"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, -1).unbind(1)
        attended = varlen_attention(q, k, v, cu_seqlens, max_seqlen)
        x = x + self.proj(attended.reshape(tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PackedViT(nn.Module):
    def __init__(
        self, patch_dim: int = 48, dim: int = 64, depth: int = 2, heads: int = 4, out_dim: int = 64, merge: int = 1
    ) -> None:
        super().__init__()
        self.merge = merge
        self.embed = nn.Linear(patch_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.merger = nn.Linear(merge * dim, out_dim)

    def forward(self, patches: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen)
        x = self.norm(x)
        return self.merger(x.reshape(-1, self.merge * x.shape[-1]))


def pack_images(lengths: list[int], patch_dim: int, *, device=None, dtype=None, generator=None):
    """Random packed patches for images of ``lengths`` patches: ``(patches, cu_seqlens, max_seqlen)``."""
    patches = torch.randn(sum(lengths), patch_dim, generator=generator, dtype=dtype).to(device)
    cu_seqlens = segments.cu_seqlens(lengths, device)
    return patches, cu_seqlens, max(lengths)


class WindowedViT(PackedViT):
    """PackedViT with Qwen2.5-VL's layout: tokens permuted into windows of merged tokens, window attention in
    every block but the full-attention ones, and the merged output put back in the caller's order.

    ``forward(patches, cu_seqlens, max_seqlen, cu_window_seqlens, max_window_seqlen, window_index)``, with
    ``window_index``/``cu_window_seqlens`` from ``VisionGeometry.window_metadata`` (merge 4 = 2 x 2).
    """

    def __init__(self, *args, full_attention_blocks: tuple[int, ...] = (1,), **kwargs) -> None:
        kwargs.setdefault("merge", 4)
        super().__init__(*args, **kwargs)
        self.full_attention_blocks = full_attention_blocks

    def forward(self, patches, cu_seqlens, max_seqlen, cu_window_seqlens, max_window_seqlen, window_index):
        x = self.embed(patches)
        tokens, width = x.shape
        x = x.reshape(tokens // self.merge, self.merge, width)[window_index].reshape(tokens, width)
        for index, block in enumerate(self.blocks):
            if index in self.full_attention_blocks:
                x = block(x, cu_seqlens, max_seqlen)
            else:
                x = block(x, cu_window_seqlens, max_window_seqlen)
        merged = self.merger(self.norm(x).reshape(-1, self.merge * width))
        return merged[torch.argsort(window_index)]


class ClsViT(PackedViT):
    """PackedViT with a learned CLS row before each image's patches, scattered in the graph: the attention runs
    over ``patches + images`` rows, with offsets ``cu_seqlens + [0, 1, ..., images]``.

    ``forward(patches, cu_seqlens, max_seqlen) -> (cls [images, out_dim], patch rows [N, out_dim])``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cls = nn.Parameter(torch.randn(self.embed.out_features) * 0.02)

    def forward(self, patches, cu_seqlens, max_seqlen):
        images = cu_seqlens.shape[0] - 1
        shift = torch.arange(images + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        token_offsets = cu_seqlens + shift
        index = torch.arange(patches.shape[0], dtype=cu_seqlens.dtype, device=patches.device)
        image = torch.searchsorted(cu_seqlens[1:-1], index, right=True)
        patch_rows = (index + image + 1).long()
        cls_rows = token_offsets[:-1].long()
        return self.encode_placed(patches, token_offsets, max_seqlen + 1, cls_rows, patch_rows)

    def encode_placed(self, patches, token_offsets, max_seqlen, cls_rows, patch_rows):
        """The CLS rows written at ``cls_rows`` and the embedded patches at ``patch_rows`` of ``patches + images``
        rows, the blocks over ``token_offsets``: ``(cls [images, out_dim], patch rows [N, out_dim])``."""
        x = self.embed(patches)
        images = cls_rows.shape[0]
        rows = x.new_zeros(patches.shape[0] + images, x.shape[1])
        rows = rows.index_copy(0, patch_rows, x).index_copy(0, cls_rows, self.cls.expand(images, -1))
        for block in self.blocks:
            rows = block(rows, token_offsets, max_seqlen)
        out = self.merger(self.norm(rows))
        return out[cls_rows], out[patch_rows]


class PlacedClsViT(ClsViT):
    """ClsViT whose rows are placed by index inputs the host computes (``place_cls_rows``), as a packed encoder
    outside HF does: ``cls_rows`` (each image's first row, ``cu_seqlens[:-1]``) and ``patch_rows`` (the others)
    write into ``patches + images`` rows, and ``cu_seqlens`` counts those rows (CLS included).

    ``forward(patches, cu_seqlens, max_seqlen, cls_rows, patch_rows) -> (cls [images, out_dim], patch rows)``;
    the same weights give ``ClsViT``'s outputs.
    """

    def forward(self, patches, cu_seqlens, max_seqlen, cls_rows, patch_rows):
        return self.encode_placed(patches, cu_seqlens, max_seqlen, cls_rows, patch_rows)


def place_cls_rows(lengths: list[int], patch_dim: int, *, device=None, generator=None):
    """Random packed patches of images of ``lengths`` patches and their placement with a CLS row before each:
    ``(patches, cu_seqlens, max_seqlen, cls_rows, patch_rows)`` for ``PlacedClsViT`` (``cu_seqlens`` and
    ``max_seqlen`` count the CLS rows)."""
    patches, _, longest = pack_images(lengths, patch_dim, device=device, generator=generator)
    cu_seqlens = segments.cu_seqlens([length + 1 for length in lengths], device)
    cls_rows = cu_seqlens[:-1].long()
    is_patch = torch.ones(int(cu_seqlens[-1]), dtype=torch.bool, device=device)
    is_patch[cls_rows] = False
    return patches, cu_seqlens, longest + 1, cls_rows, is_patch.nonzero().squeeze(1)


class RegisterViT(PackedViT):
    """PackedViT with ``registers`` learned rows after each image's patches (ViT registers), scattered in the
    graph: the attention runs over ``patches + registers * images`` rows; the registers are dropped at the end.

    ``forward(patches, cu_seqlens, max_seqlen) -> patch rows [N, out_dim]``.
    """

    def __init__(self, *args, registers: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.registers = nn.Parameter(torch.randn(registers, self.embed.out_features) * 0.02)

    def forward(self, patches, cu_seqlens, max_seqlen):
        x = self.embed(patches)
        count = self.registers.shape[0]
        images = cu_seqlens.shape[0] - 1
        shift = count * torch.arange(images + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        token_offsets = cu_seqlens + shift
        index = torch.arange(patches.shape[0], dtype=cu_seqlens.dtype, device=patches.device)
        image = torch.searchsorted(cu_seqlens[1:-1], index, right=True)
        patch_rows = (index + count * image).long()
        register_rows = (token_offsets[1:, None] - count + torch.arange(count, device=patches.device)).long()
        rows = x.new_zeros(patches.shape[0] + count * images, x.shape[1])
        rows = rows.index_copy(0, patch_rows, x)
        rows = rows.index_copy(0, register_rows.reshape(-1), self.registers.repeat(images, 1))
        for block in self.blocks:
            rows = block(rows, token_offsets, max_seqlen + count)
        return self.merger(self.norm(rows))[patch_rows]
