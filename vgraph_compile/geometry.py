"""``VisionGeometry``: static bounds of a ViT's packed sizes, derived with sympy from its merge geometry.

A call packs items (images: 1 frame; videos: ``t`` temporal patches, each a frame) whose frames are ``h x w``
patch grids, ``h`` and ``w`` multiples of the spatial merge ``m``. With a token budget ``B`` (patches),
``F`` frames at most, and windows of ``w`` merged tokens a side:

- tokens <= B; merged tokens <= floor(B / m^2);
- frames (segments of full attention) <= min(F, floor(B / m^2)): every frame holds at least m^2 patches;
- windows <= min(T, floor((T + S (w - 1)) / w)) with T merged tokens and S frames: a frame of T_f merged tokens
  has ceil(H/w) ceil(W/w) <= ceil(T_f / w) windows (its grid holds at least ((a-1)w+1)((b-1)w+1) tokens), and
  sum ceil(T_f / w) <= (T + S (w - 1)) / w;
- max_seqlen of full attention <= floor(B / m^2) m^2 (one frame takes the whole budget);
  of window attention <= min(w^2 m^2, that).
Each bound is reached: one strip frame, S frames of m x m, thin strips of 1 x (w + 1) merged tokens.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import sympy

if TYPE_CHECKING:
    import torch

__all__ = ["VisionGeometry", "GeometryBounds"]

_B, _F, _M, _W = sympy.symbols("B F m w", integer=True, positive=True)
_T = sympy.floor(_B / _M**2)
_S = sympy.Min(_F, _T)
_EXPRESSIONS: dict[str, sympy.Expr] = {
    "tokens": _B,
    "merged_tokens": _T,
    "segments": _S,
    "windows": sympy.Min(_T, sympy.floor((_T + _S * (_W - 1)) / _W)),
    "max_seqlen_full": _T * _M**2,
    "max_seqlen_window": sympy.Min(_W**2 * _M**2, _T * _M**2),
    "window_index": _T,
}


@dataclass(frozen=True)
class GeometryBounds:
    """The bound of every packed size for one budget (fields named as ``_EXPRESSIONS``); ``explain()`` gives
    the sympy derivation."""

    tokens: int
    merged_tokens: int
    segments: int
    windows: int
    max_seqlen_full: int
    max_seqlen_window: int
    window_index: int
    derivation: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, int]:
        """Each bounded size by name, in derivation order."""
        return {key: getattr(self, key) for key in _EXPRESSIONS}

    def explain(self) -> str:
        return "\n".join(f"{key} = {expr} = {getattr(self, key)}" for key, expr in self.derivation)


@dataclass(frozen=True)
class VisionGeometry:
    """Patch and merge geometry of a ViT (Qwen2-VL: patch 14; Qwen2.5-VL: window 112; Qwen3-VL: patch 16)."""

    patch_size: int
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int | None = None
    """Window side in pixels (Qwen2.5-VL: 112); None when the model has no window attention."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"VisionGeometry.{name} must be positive, got {getattr(self, name)}")
        if self.window_size is not None and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"VisionGeometry.window_size={self.window_size} is not a multiple of patch_size x "
                f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}: windows must hold whole "
                "merged tokens"
            )

    def patch_width(self, channels: int) -> int:
        """Values in one patch row of ``channels``-channel pixels: channels x temporal patch x patch x patch
        (Qwen2.5-VL: 3 x 2 x 14 x 14 = 1176)."""
        return channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_window(self) -> int | None:
        """Window side in merged tokens (Qwen2.5-VL: 112 / 14 / 2 = 4)."""
        if self.window_size is None:
            return None
        return self.window_size // self.patch_size // self.spatial_merge_size

    @functools.lru_cache(maxsize=1024)
    def bounds(self, token_budget: int, max_items: int, max_frames: int | None = None) -> GeometryBounds:
        """Upper bounds for a call of at most ``token_budget`` patches, ``max_items`` items and ``max_frames``
        frames in all (default: one per item). Windows are those of ``window_size`` (none: 0). Cached: the
        geometry and the result are frozen, and every config and bounds pass asks for the same budgets."""
        if token_budget <= 0 or max_items <= 0:
            raise ValueError(f"token_budget ({token_budget}) and max_items ({max_items}) must be positive")
        frames = max_items if max_frames is None else max_frames
        if frames < max_items:
            raise ValueError(f"max_frames ({frames}) < max_items ({max_items}): every item has a frame")
        merge = self.spatial_merge_size
        if token_budget < merge * merge:
            raise ValueError(
                f"token_budget {token_budget} holds no frame: the smallest frame has {merge * merge} patches"
            )
        substitution = {
            symbol: sympy.Integer(value)
            for symbol, value in ((_B, token_budget), (_F, frames), (_M, merge), (_W, self.merged_window or 1))
        }
        values, derivation = {}, []
        for key, expr in _EXPRESSIONS.items():
            value = int(expr.xreplace(substitution))  # exact on integers; ~150x faster than subs
            if key in ("windows", "max_seqlen_window") and self.window_size is None:
                value, expr = 0, sympy.Integer(0)
            values[key] = value
            derivation.append((key, str(expr)))
        return GeometryBounds(**values, derivation=tuple(derivation))

    def frame_offsets(self, grid_thw: Sequence[Sequence[int]]) -> "torch.Tensor":
        """int32 cu_seqlens of full attention: one segment per frame (temporal patch) of every item."""
        from vgraph_compile.kernels.segments import cu_seqlens

        return cu_seqlens([h * w for t, h, w in grid_thw for _ in range(t)])

    def window_metadata(self, grid_thw: Sequence[Sequence[int]]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(window_index, cu_window_seqlens) for window attention, as Qwen2.5-VL orders them.

        ``window_index`` permutes merged tokens so each window's tokens are contiguous (windows in row-major
        order within each frame, frames in order); ``cu_window_seqlens`` (int32, in patches) delimits them.
        """
        import torch

        from vgraph_compile.kernels.segments import cu_seqlens

        if self.window_size is None:
            raise ValueError("window_metadata needs a geometry with window_size")
        merge, side = self.spatial_merge_size, self.merged_window
        order, lengths, start = [], [], 0
        for t, h, w in grid_thw:
            rows, cols = h // merge, w // merge
            index = torch.arange(t * rows * cols).view(t, rows, cols) + start
            for frame in index:
                for top in range(0, rows, side):
                    for left in range(0, cols, side):
                        window = frame[top : top + side, left : left + side].reshape(-1)
                        order.append(window)
                        lengths.append(window.numel() * merge * merge)
            start += t * rows * cols
        return torch.cat(order), cu_seqlens(lengths)
