"""What the ranks agree on (``hf/parallel/rank_agreement``), in groups of 2 gloo processes on toy towers: a rank whose
capture dropped a bucket makes every rank serve its sequence graphs, their warm-up call included, from the buckets
all captured; a rank failing after the batch check (its data share, its sequence slice, or its sequence graph after
the all-to-alls) makes every rank raise the same ``RankFailure`` within seconds, and the group serves the next call.

The groups (``tests/hf/gloo_group.py``) run the checks of ``CHECKS``, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
(a rank issuing another c10d collective than the others raises); a rank left waiting would raise only at the
group's 60 s timeout, which the checks' time limit is well under.
"""

import time

import pytest
import torch
import torch.distributed as dist

from tests.hf.gloo_group import compiled, inputs, parallel, passed_on_every_rank, single
from vgraph_compile.compile import artifacts
from vgraph_compile.compile.assemble import CompiledEncoder
from vgraph_compile.hf.parallel.parallel_error import output_fields
from vgraph_compile.hf.parallel.rank_agreement import RankFailure, grid_hash

SECONDS = 10.0
"""Each failing call must raise on every rank within this (the group's timeout is 60 s)."""


def test_grid_hash_tells_order_and_frames_apart():
    hashes = {grid_hash(g) for g in ([(1, 8, 4), (1, 8, 8)], [(1, 8, 8), (1, 8, 4)], [(2, 8, 4), (1, 8, 8)], [])}
    assert len(hashes) == 4 and all(0 <= h < 2**62 for h in hashes)


def _drop_smallest_bucket_when_capturing(self, *args, **kwargs):
    """``CompiledEncoder.warmup`` as on a rank whose capture of the smallest bucket ran out of memory."""
    if not self.captured:
        self.buckets = self.buckets[1:]
    return _capture(self, *args, **kwargs)


_capture = CompiledEncoder.warmup


def _warm_up_serves_from_buckets_every_rank_captured(group):
    """Qwen3-VL's sequence warm-up slice (16 rows) fits budget 64, which rank 1 does not capture: every rank serves
    the warm-up and the next call from budget 256 (a rank replaying 64 against another's 256 would send all-to-alls
    of other sizes), and the output equals the stock tower's."""
    tower = compiled("qwen3-vl", group)
    tower.close()  # the next sequence call makes the graphs again, captured under the patch
    with pytest.MonkeyPatch.context() as patch, parallel(tower, "sequence"), torch.no_grad():
        patch.setenv(artifacts.ENVIRONMENT_VARIABLE, "")  # no saved plan's buckets are loaded, none saved
        if dist.get_rank(group) == 1:
            patch.setattr(CompiledEncoder, "warmup", _drop_smallest_bucket_when_capturing)
        pixel_values, grid_thw = inputs(tower, [(1, 8, 8)], 0)
        out, stock = tower(pixel_values, grid_thw), tower.tower(pixel_values, grid_thw)
    (runtime,) = tower.sequence_graphs.compiled.vgraph.runtimes
    assert [bucket.shape.budget for bucket in runtime.buckets] == [256]
    assert runtime.buckets[0].stats.hits == 2  # the warm-up and the call
    for mine, theirs in zip(output_fields(out), output_fields(stock), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    tower.close()  # later checks make graphs of both budgets


def _raises_on_every_rank(tower, pixel_values, grid_thw, message: str) -> None:
    """The call raises the same ``RankFailure`` on every rank, within ``SECONDS``."""
    begin = time.monotonic()
    with pytest.raises(RankFailure) as raised:
        tower(pixel_values, grid_thw)
    assert time.monotonic() - begin < SECONDS
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, str(raised.value))
    assert len(set(every)) == 1 and f"rank 1: {message}" in every[0], every


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("out of memory on this rank (injected)")


def _a_rank_failing_after_the_check_raises_on_every_rank(group):
    """Rank 1 alone runs out of memory encoding its data-parallel share, then cutting its sequence-parallel slice,
    then fails in its sequence graph after the all-to-alls: every rank raises the same error naming rank 1, and
    the group serves the next call in each mode."""
    tower = compiled("qwen2.5-vl", group)
    rank = dist.get_rank(group)
    pixel_values, grid_thw = inputs(tower, [(1, 8, 8), (1, 8, 12), (1, 16, 8)], 0)
    with torch.no_grad():
        alone = single(tower, pixel_values, grid_thw)
    for mode, where in (("data", "compiled"), ("sequence", "slice"), ("sequence", "graph")):
        with parallel(tower, mode), torch.no_grad():
            tower(pixel_values, grid_thw)  # the sequence graphs exist before one is patched
            with pytest.MonkeyPatch.context() as patch:
                if rank == 1 and where == "compiled":
                    patch.setattr(tower.compiled, "call_keyed", _out_of_memory)
                elif rank == 1 and where == "slice":
                    patch.setattr(tower, "_sequence_slice", _out_of_memory)
                elif rank == 1:
                    graphs = tower.sequence_graphs.compiled
                    encode = graphs.call_keyed

                    def fails_after_the_attention(*args, **kwargs):
                        encode(*args, **kwargs)
                        raise RuntimeError("the merger failed on this rank (injected)")

                    patch.setattr(graphs, "call_keyed", fails_after_the_attention)
                message = "RuntimeError: the merger" if where == "graph" else "OutOfMemoryError: out of memory"
                _raises_on_every_rank(tower, pixel_values, grid_thw, message)
            out = tower(pixel_values, grid_thw)
        for mine, theirs in zip(output_fields(out), output_fields(alone), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def _every_rank_failing_raises_its_own_error(group):
    """Every rank failing alike (the same code on the same batch) raises its own error, not a ``RankFailure``."""
    tower = compiled("qwen2.5-vl", group)
    with pytest.MonkeyPatch.context() as patch, parallel(tower, "data"), torch.no_grad():
        patch.setattr(tower.compiled, "call_keyed", _out_of_memory)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            tower(*inputs(tower, [(1, 8, 8), (1, 8, 12)], 0))


def _a_trace_refused_at_the_first_call_hands_down_on_every_rank(group):
    """Muse's whole-tower trace is refused at its first call (its attention reads ``max_seqlen`` with ``.item()``):
    over a process group, every rank hands the tower down to block graphs at that call, with no collective issued
    by one rank and not the other, and each serves it whole, equal to the stock tower; the next call too."""
    from vgraph_compile.hf import CompiledBlockTower, compile_vision_tower, routed_attention
    from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

    tower = build_tower("muse_spark", tiny=True)
    served = compile_vision_tower(
        tower, token_budgets=[256], compiler="eager", attention_backend="sdpa", process_group=group
    )
    for grid in ([(1, 8, 12)], [(1, 4, 8), (1, 8, 8)]):
        args, kwargs = tower_call("muse_spark", tower, grid)
        with torch.no_grad():
            out = served(*args, **kwargs)
        with torch.no_grad(), routed_attention(tower):
            ref = tower(*args, **kwargs)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    assert isinstance(served.replacement, CompiledBlockTower)


def _fresh_tower(group):
    """A toy Qwen2-VL tower compiled over ``group`` in data mode, never called (closed with the group)."""
    from tests.hf.gloo_group import OPTIONS, _TOWERS
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    stock = qwen_tower("qwen2-vl", "cpu", torch.float32, **TOY_SIZES["qwen2-vl"])
    _TOWERS.append(compile_vision_tower(stock, process_group=group, **{**OPTIONS, "parallel": "data"}))
    return _TOWERS[-1], stock


def _a_rank_failing_its_first_warm_up_raises_on_every_rank(group):
    """Rank 1's first warm-up fails, after its runtimes were built (its replay of the synthetic image, injected) or
    before (its trace, injected, so rank 0 alone is warmed): that call raises the same ``RankFailure`` on every
    rank, promptly; the next call is served, equal to the stock tower, both ranks taking the warm-up's agreement
    alike (a warmed rank skipping it would pair its next collective with the other's)."""
    from vgraph_compile.compile.buckets import Bucket
    from vgraph_compile.hf.whole_graph.whole_tower import CompiledVisionTower

    for failing in (Bucket, CompiledVisionTower):
        tower, stock = _fresh_tower(group)
        pixel_values, grid_thw = inputs(tower, [(1, 8, 8), (1, 8, 12)], 0)
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            patch.setenv(artifacts.ENVIRONMENT_VARIABLE, "")  # its own build, not a plan another check saved
            if dist.get_rank(group) == 1:
                patch.setattr(failing, "run" if failing is Bucket else "_warm_up", _out_of_memory)
            _raises_on_every_rank(tower, pixel_values, grid_thw, "OutOfMemoryError: out of memory")
        assert bool(tower.compiled.vgraph.runtimes) == (failing is Bucket or dist.get_rank(group) == 0)
        with torch.no_grad():
            out, alone = tower(pixel_values, grid_thw), stock(pixel_values, grid_thw)
        for mine, theirs in zip(output_fields(out), output_fields(alone), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


CHECKS = {
    2: [
        _warm_up_serves_from_buckets_every_rank_captured,
        _a_rank_failing_after_the_check_raises_on_every_rank,
        _every_rank_failing_raises_its_own_error,
        _a_trace_refused_at_the_first_call_hands_down_on_every_rank,
        _a_rank_failing_its_first_warm_up_raises_on_every_rank,
    ]
}


test_passed_on_every_rank = passed_on_every_rank(CHECKS)
