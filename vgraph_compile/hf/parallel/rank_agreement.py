"""What the ranks of a process group agree on before a step whose collectives they must all issue alike: no rank
issues a collective another does not. Each agreement is one small all-reduce on the check group (``check_group``),
which every rank reaches at the same point of the same call.

- **The batch** (``same_batch``), first in every call: a 62-bit hash of ``grid_thw`` (``grid_hash``, or
  ``REFUSED`` where this rank's input check failed) all-reduced with MAX over ``[hash, -hash]``; unequal hashes
  mean the ranks got different batches, and every rank raises before any other collective. The same all-reduce
  tells whether some rank's local graphs are not yet warmed up (a flag, MAX): then every rank takes the first
  warm-up's step and its agreement, a warmed rank with nothing to do.
- **Every rank's success** (``agree_on_success``), after each rank's own work on a call and before the collectives
  that need every rank's part (the sequence graphs' all-to-alls, the gathers): one all-reduce (MAX) of a flag per
  rank. A rank whose work raised (its tower on its share, out of memory, an item only it holds) sets its flag
  instead of raising; every rank then gathers the failed ranks' messages (``all_gather_object``, on that path only)
  and raises the same ``RankFailure``, the failed rank's own error as its cause (where every rank failed, each
  raises its own error). No rank is left waiting in a collective the others skipped, and the group serves the
  next call.
- **The captured buckets** (``common_budgets``), once per trace whose graphs hold collectives, after its captures
  and before it serves any call, its warm-up call included (``VGraphRuntime.agree_buckets``): one all-reduce (MIN)
  of which budgets each rank captured (a capture out of memory drops its bucket on that rank only). Every rank keeps
  the buckets all captured, so all choose the same bucket for a call and replay the same collectives.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "REFUSED", "RankFailure", "agree_on_success", "check_group", "common_budgets", "grid_hash", "same_batch"
]

log = logging.getLogger(__name__)

Rows = tuple[int, int, int]

REFUSED = 1 << 62
"""The batch check's key of a rank whose own input check failed: above every ``grid_hash``, so the others see a
mismatch and raise too."""


class RankFailure(RuntimeError):
    """A rank of the process group failed on a call after the batch check; every rank raises it, with one message."""


def grid_hash(grid: list[Rows] | tuple[Rows, ...]) -> int:
    """A 62-bit hash of the grid rows, the same in every process (``hash()`` of a tuple is not)."""
    text = ";".join(f"{t},{h},{w}" for t, h, w in grid)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


_CHECK_GROUPS: dict[Any, Any] = {}
"""Per process group on an accelerator: a gloo group of the same ranks, for the agreements."""


def check_group(group, device: torch.device) -> tuple[Any, torch.device]:
    """(group, device) the agreements run on: ``group`` itself on the CPU, or, for a group on an accelerator
    (NCCL), a gloo group of the same ranks made at the group's first call (every rank makes its first call with the
    same batch, so all make it together). An agreement is read on the host: on the accelerator that read would wait
    for all the work queued before it (the previous call's gather among it), so the host could not queue the next
    call's fill while the previous call's gather runs; on gloo it waits for the agreement alone."""
    if device.type == "cpu":
        return group, device
    side = _CHECK_GROUPS.get(group)
    if side is None:
        ranks = dist.get_process_group_ranks(group)
        side = _CHECK_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return side, torch.device("cpu")


def same_batch(key: int, group, device: torch.device, cold: bool = False) -> tuple[bool, bool]:
    """(whether every rank of ``group`` passed the same ``key``, whether some rank is ``cold``): one all-reduce
    (MAX of ``[key, -key, cold]``)."""
    values = torch.tensor([key, -key, int(cold)], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    high, negative_low, any_cold = values.tolist()
    return high == -negative_low, bool(any_cold)


def agree_on_success(failure: Exception | None, group, device: torch.device) -> None:
    """Return on every rank when no rank of ``group`` failed (``failure`` None everywhere: one all-reduce). When
    every rank failed, each raises its own ``failure`` (the same code on the same batch: a refused budget stays a
    ``ValueError``). Else every rank raises the same ``RankFailure``, naming each failed rank and its error (this
    rank's ``failure`` the cause)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    flags = torch.zeros(ranks, dtype=torch.int32, device=device)
    flags[rank] = failure is not None
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed = [index for index, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    if len(failed) == ranks:
        raise failure
    messages: list[str | None] = [None] * ranks
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(messages, mine, group=group)
    detail = "; ".join(f"rank {index}: {messages[index]}" for index in failed)
    raise RankFailure(
        f"{len(failed)} of {ranks} ranks of the process group failed on this call, so no rank gathers its outputs "
        f"({detail}); every rank raises this error, and the group serves the next call"
    ) from failure


def common_budgets(held: set[int], budgets: tuple[int, ...], group, device: torch.device) -> set[int]:
    """The budgets of ``budgets`` that every rank of ``group`` holds (``held``: this rank's): one all-reduce (MIN)."""
    mask = torch.tensor([budget in held for budget in budgets], dtype=torch.int32, device=device)
    dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=group)
    everywhere = {budget for budget, kept in zip(budgets, mask.tolist()) if kept}
    if everywhere != held:
        log.warning(
            "budgets %s are not captured on every rank of the process group; every rank serves from %s",
            sorted(held - everywhere),
            sorted(everywhere),
        )
    return everywhere
