"""Data-parallel encoding over a ``torch.distributed`` process group (vLLM's ``mm_encoder_tp_mode="data"``).

Every rank holds the whole tower and is called with the same full batch, as tensor-parallel ranks receive the
same multimodal inputs. Per call, on every rank:

1. **Check**: every rank got the same batch (``rank_agreement.same_batch``), before any other collective.
2. **Assign** (``assign``): a pure function of the grid, so every rank computes the same one with no
   communication: items (a video with all its frames) greedily, largest first, onto the least-loaded rank.
   ``CompiledVisionTower`` may first cut a video larger than a rank's fair share into items of whole frames, where
   the tower's metadata shows that gives the same rows (``parallel_plan.split_frames``).
3. **Encode**: each rank packs its share into its own buckets (the tower's ordinary call).
4. **Agree** that every rank's encode succeeded (``rank_agreement.agree_on_success``): a rank whose share raised
   makes every rank raise the same error instead of leaving the others in the gather.
5. **Gather** (``gather``): one ``all_gather_into_tensor`` of every rank's outputs side by side in one buffer
   (``[merged rows, sum of field widths]``, ``last_hidden_state`` folded ``merge^2`` patch rows per merged row),
   each rank's rows padded to the largest rank's (row counts come from the grid), then cut back into the
   caller's item order. A rank with no item sends padding only.

The collective runs outside the captured graphs (so no graph holds the communicator); nothing reads device data
back to the host. gloo supports ``all_gather_into_tensor`` on CPU tensors in every torch this package supports (its
``_allgather_base`` predates torch 2.11), so gloo and NCCL take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Assignment", "LoadStats", "assign", "gather"]

Rows = tuple[int, int, int]


@dataclass(frozen=True)
class Assignment:
    """Which of the caller's items each rank encodes (ascending indices) and its load in patches."""

    items: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """max / mean load (1.0: perfectly balanced; the number of ranks: one rank does everything)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0


def assign(grid: list[Rows] | tuple[Rows, ...], ranks: int) -> Assignment:
    """Items largest first (ties: lower index first), each onto the least-loaded rank (ties: lower rank).

    Every item goes to exactly one rank, whole. The greedy bound holds: the most loaded rank was the least
    loaded when it took its last item, so ``max(loads) <= mean(loads) + the largest item``.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    sizes = [t * h * w for t, h, w in grid]
    loads = [0] * ranks
    items: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(grid)), key=lambda index: (-sizes[index], index)):
        rank = min(range(ranks), key=lambda rank: (loads[rank], rank))
        items[rank].append(index)
        loads[rank] += sizes[index]
    return Assignment(tuple(tuple(sorted(share)) for share in items), tuple(loads))


_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch >= 2.13 names it ``all_gather_single`` (the old name warns); the same collective."""


def gather(
    local: list[torch.Tensor],
    folds: list[int],
    units: list[int],
    assignment: Assignment,
    rank: int,
    group,
) -> list[torch.Tensor]:
    """Every rank's ``local`` outputs, in the caller's item order, on every rank.

    ``local[f]`` holds this rank's items in its ascending order, ``folds[f]`` rows per unit (a merged token:
    1 for pooler and deepstack outputs, ``merge^2`` for last_hidden_state); item ``i`` has ``units[i]`` units.
    One collective for all fields: they sit side by side in one ``[units, sum(fold * width)]`` buffer.
    """
    widths = [fold * output.shape[1] for fold, output in zip(folds, local)]
    rank_units = [sum(units[index] for index in share) for share in assignment.items]
    rows = max(rank_units)
    send = local[0].new_empty(rows, sum(widths))
    column = 0
    for output, width in zip(local, widths):
        send[: rank_units[rank], column : column + width] = output.reshape(rank_units[rank], width)
        column += width
    received = send.new_empty(len(rank_units) * rows, sum(widths))
    _all_gather_into_tensor(received, send, group=group)
    received = received.view(len(rank_units), rows, sum(widths))
    runs = _runs(units, assignment)
    out, column = [], 0
    for output, width in zip(local, widths):
        pieces = [received[r, start:stop, column : column + width] for r, start, stop in runs]
        out.append(torch.cat(pieces).view(-1, output.shape[1]))
        column += width
    return out


def _runs(units: list[int], assignment: Assignment) -> list[tuple[int, int, int]]:
    """(rank, first unit, end unit) slices of the gathered rows that, concatenated, give the caller's order:
    consecutive items on one rank are one slice."""
    where: dict[int, tuple[int, int]] = {}
    for rank, share in enumerate(assignment.items):
        offset = 0
        for index in share:
            where[index] = (rank, offset)
            offset += units[index]
    runs: list[tuple[int, int, int]] = []
    for index in range(len(units)):
        rank, start = where[index]
        if runs and runs[-1][0] == rank and runs[-1][2] == start:
            runs[-1] = (rank, runs[-1][1], start + units[index])
        else:
            runs.append((rank, start, start + units[index]))
    return runs


@dataclass
class LoadStats:
    """Per-rank load over the data-parallel calls of one tower."""

    patches: list[int] = field(default_factory=list)
    """Patches each rank encoded, summed over calls."""
    calls: int = 0
    imbalances: list[float] = field(default_factory=list)
    """max / mean patches of each call that had any."""

    def record(self, assignment: Assignment) -> None:
        if not self.patches:
            self.patches = [0] * len(assignment.loads)
        self.patches = [a + b for a, b in zip(self.patches, assignment.loads)]
        self.calls += 1
        if sum(assignment.loads):
            self.imbalances.append(assignment.imbalance)

    def table(self, rank: int) -> str:
        lines = [f"data parallel over {len(self.patches)} ranks (this is rank {rank}), {self.calls} calls"]
        lines.append(f"{'rank':>6} {'patches':>10} {'share':>7}")
        total = sum(self.patches) or 1
        for index, patches in enumerate(self.patches):
            lines.append(f"{index:>6} {patches:>10} {patches / total:>7.1%}")
        if self.imbalances:
            mean = sum(self.imbalances) / len(self.imbalances)
            lines.append(f"imbalance (max/mean patches per call): mean {mean:.3f}, worst {max(self.imbalances):.3f}")
        return "\n".join(lines)
