"""``pipeline``: the backend runs every stage once, in the table's order; a saved plan runs only the stages it
leaves; bad input stops the stages before anything is rewritten or compiled."""

import pytest
import torch

import vgraph_compile
from vgraph_compile import pipeline
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


@pytest.fixture
def visited(monkeypatch):
    """The names of the stages run, in order, while the test runs (each stage's function wrapped)."""
    names: list[str] = []
    for stage in pipeline.STAGES:
        function = getattr(pipeline, stage.function)

        def recorded(*args, stage=stage, function=function, **kwargs):
            names.append(stage.name)
            return function(*args, **kwargs)

        monkeypatch.setattr(pipeline, stage.function, recorded)
    return names


def _moved(before: dict[str, int]) -> dict[str, int]:
    after = counters.snapshot()
    return {name: after[name] - before[name] for name in ("traces", "compiles", "plans_loaded", "replays")}


def _compiled(artifact_dir):
    """Through the decorator, whose trace options fold float constants: aot_autograd never asks dynamo to trace
    again (which would run the stages again from the start)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    return model, vgraph_compile.encoder(model, token_budgets=(32, 64), max_segments=4, artifact_dir=str(artifact_dir))


def test_a_trace_visits_each_stage_once_in_order(tmp_path, visited):
    model, compiled = _compiled(tmp_path)
    inputs = pack_images([5, 9], 12)
    before = counters.snapshot()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert _moved(before) == {"traces": 1, "compiles": 1, "plans_loaded": 0, "replays": 1}
    assert visited == [stage.name for stage in pipeline.STAGES] == ["analyze", "check_call", "rewrite", "compile", "assemble"]


def test_a_saved_plan_runs_only_the_checks_and_the_assembly(tmp_path, visited):
    """The same encoder compiled again finds its build plan: no trace, analyses, rewrites or compile."""
    model, compiled = _compiled(tmp_path)
    inputs = pack_images([5, 9], 12)
    with torch.no_grad():
        compiled(*inputs)
    visited.clear()
    model, compiled = _compiled(tmp_path)
    before = counters.snapshot()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert _moved(before) == {"traces": 0, "compiles": 0, "plans_loaded": 1, "replays": 1}
    assert visited == [stage.name for stage in pipeline.PLAN_STAGES] == ["check_call", "assemble"]


def test_bad_input_stops_before_the_rewrites(tmp_path, visited):
    """A first call whose cu_seqlens decrease is refused by the call checks: nothing is rewritten or compiled."""
    _, compiled = _compiled(tmp_path)
    patches, _, max_seqlen = pack_images([5, 9], 12)
    decreasing = torch.tensor([0, 9, 5, 14], dtype=torch.int32)
    before = counters.snapshot()
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease"):
        compiled(patches, decreasing, max_seqlen)
    assert _moved(before)["compiles"] == 0
    assert visited == ["analyze", "check_call"]
