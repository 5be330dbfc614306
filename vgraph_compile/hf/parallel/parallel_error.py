"""How far a call encoded over several ranks may be from the same call on one rank, and how it is measured.

Over several ranks every output row is computed by the same operations on the same values as on one rank. What
changes is only the layout of the work: the rows a kernel is called with (a rank's share or slice, in its own
bucket, against the whole batch in one) and, sequence parallel, the heads each rank attends (head-parallel
all-to-alls) over the whole sequence. The all-to-alls, index gathers and the final gather move values without
arithmetic (bf16 q/k/v travel as bf16, unrounded); padding rows and zero-padded heads never enter a real row (a
segment's rows depend on that segment alone). A kernel may still pick another accumulation order for another
layout: a GEMM's split and tiles by its row count, an attention kernel's blocks by the total length and offsets.
Each such op accumulates in float32 and rounds its output once, so the two layouts give two roundings of the same
operations, and the output over several ranks is another evaluation of the tower in its dtype, as accurate as one
rank's. Two evaluations within ``e`` of the exact output are within ``2 e`` of each other, so the bound per call is

    ``relative_error(several ranks, one rank) <= ERROR_BOUND_FACTOR * relative_error(one rank, float64 reference)``

in every mode (data, sequence, both), where the reference is the stock tower in float64 on the same input
(``Float64Reference``). In bfloat16 (unit roundoff ``u = 2^-8``) ``e`` is a few ``u`` at the output's scale (the
final norm keeps it from growing with depth), so the bound is of order 1e-2; in float32 of order 1e-6.

Data parallel runs each item through the same compiled code as one rank, alone or with other items: where its
kernels see the same layout (an item alone on its rank, against that item alone on one rank) the rows are bitwise
equal; otherwise the bound above holds.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["ERROR_BOUND_FACTOR", "Float64Reference", "output_fields", "relative_error"]

ERROR_BOUND_FACTOR = 2.0
"""The bound's factor on one rank's own error against the float64 reference (module docstring)."""


def output_fields(out: Any) -> list[torch.Tensor]:
    """The tensors of a packed tower's output: pooler_output, last_hidden_state and Qwen3-VL's deepstack features."""
    return [out.pooler_output, out.last_hidden_state, *(getattr(out, "deepstack_features", None) or ())]


def relative_error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """``||outputs - reference|| / ||reference||`` over every field of one call together, in float64."""
    difference = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(outputs, reference, strict=True))
    scale = sum(float(b.double().square().sum()) for b in reference)
    return (difference / scale) ** 0.5 if scale else float(difference > 0)


class Float64Reference:
    """The stock tower (eager, its own attention) in float64, a copy beside the served one: the output the
    roundings of the served dtype are measured against."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.tower = copy.deepcopy(tower).to(torch.float64)

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return output_fields(self.tower(pixel_values.to(torch.float64), grid_thw))
