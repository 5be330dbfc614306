"""The work every system gets: the fixed cases, the seeded requests, both as grids in patches, and their inputs."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

from vgraph_compile.hf.interface.packed_tower import PackedTower, learn_packed_tower

__all__ = ["CASES_PX", "to_grid", "random_requests", "Workload"]


CASES_PX = {
    "1x224^2": [(1, 224, 224)],
    "4x336^2": [(1, 336, 336)] * 4,
    "3 mixed": [(1, 224, 224), (1, 448, 672), (1, 672, 448)],
    "1x1344^2": [(1, 1344, 1344)],
    "video 16f 336^2": [(16, 336, 336)],
}
"""Fixed cases as (frames, height px, width px) per item."""


def to_grid(items_px, patch: int, temporal: int, merge: int) -> list[tuple[int, int, int]]:
    """(t, h, w) in patches, as the processor resizes: sides rounded to multiples of patch x merge."""
    unit = patch * merge

    def patches(pixels: int) -> int:
        return max(1, round(pixels / unit)) * merge

    return [(max(1, frames // temporal), patches(h), patches(w)) for frames, h, w in items_px]


def random_requests(seed: int = 0, count: int = 64) -> list[list[tuple[int, int, int]]]:
    """Requests of 1-4 images (sides 224-1344 px, aspect 1:2 to 2:1); one in six also carries a 336^2 video."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        items = []
        for _ in range(rng.randint(1, 4)):
            long_side = rng.randint(224, 1344)
            short_side = max(224, int(long_side / rng.uniform(1.0, 2.0)))
            h, w = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
            items.append((1, h, w))
        if rng.random() < 1 / 6:
            items.append((rng.choice([4, 8, 16]), 336, 336))
        out.append(items)
    return out


@dataclass
class Workload:
    """The tower, the seeded requests and the fixed cases as grids (patches), and how inputs are made."""

    tower: torch.nn.Module
    requests: list[list[tuple[int, int, int]]]
    cases: dict[str, list[tuple[int, int, int]]]
    device: torch.device
    dtype: torch.dtype

    @property
    def host_case(self) -> str:
        """The smallest fixed case: where host time per call is measured."""
        return min(self.cases, key=lambda case: sum(t * h * w for t, h, w in self.cases[case]))

    @functools.cached_property
    def interface(self) -> PackedTower:
        """What vgraph learns from the tower (its pixel row shape, grid metadata plan), learned once."""
        return learn_packed_tower(self.tower)

    def inputs(self, grid) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = torch.tensor(grid)
        shape = self.interface.pixel_shape
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), *shape, device=self.device, dtype=self.dtype)
        return pixels, grid_thw
