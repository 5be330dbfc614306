"""Factories of (encoder, example_args) for ``vgraph explain --module`` and the examples."""

from __future__ import annotations

import torch

from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.sample_models.packed_vit import ClsViT, PlacedClsViT, RegisterViT, WindowedViT, pack_images, place_cls_rows

QWEN25_GEOMETRY = VisionGeometry(patch_size=14, window_size=112)


def windowed_inputs(geometry: VisionGeometry, grid_thw, patch_dim: int, **tensor_options):
    """Random patches and the full/window attention metadata of ``grid_thw`` for ``WindowedViT``."""
    patches = torch.randn(sum(t * h * w for t, h, w in grid_thw), patch_dim).to(**tensor_options)
    cu_seqlens = geometry.frame_offsets(grid_thw)
    window_index, cu_window_seqlens = geometry.window_metadata(grid_thw)
    device = tensor_options.get("device")
    return (
        patches,
        cu_seqlens.to(device),
        int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        cu_window_seqlens.to(device),
        int((cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max()),
        window_index.to(device),
    )


def windowed_vit():
    """A small Qwen2.5-VL-shaped encoder and two images (8x12 and 4x4 patches)."""
    model = WindowedViT(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16).eval()
    return model, windowed_inputs(QWEN25_GEOMETRY, [(1, 8, 12), (1, 4, 4)], 24)


def cls_vit():
    """A ViT with a CLS row per image (tokens = patches + images) and three images of 12, 20 and 8 patches."""
    torch.manual_seed(0)
    model = ClsViT(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16).eval()
    return model, pack_images([12, 20, 8], 24)


def register_vit():
    """A ViT with 4 register rows per image (tokens = patches + 4 images) and two images of 12 and 20 patches."""
    torch.manual_seed(0)
    model = RegisterViT(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16, registers=4).eval()
    return model, pack_images([12, 20], 24)


def placed_cls_vit():
    """A ClsViT whose CLS and patch rows are placed by index inputs (tokens = patches + images), and three images
    of 12, 20 and 8 patches."""
    torch.manual_seed(0)
    model = PlacedClsViT(patch_dim=24, dim=32, depth=2, heads=2, out_dim=16).eval()
    return model, place_cls_rows([12, 20, 8], 24)
