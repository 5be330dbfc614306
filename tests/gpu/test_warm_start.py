"""On a CUDA GPU: a second process captures and replays the CUDA graphs of a saved build plan (no trace, no
compile); a tower's keyed calls replay with their metadata staged, its column-padded MLP weights held once.
Run with ``pytest -m gpu``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
CALLS = ([5, 7], [30, 20], [3])
SERVE = """
import json, sys, torch
import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
torch.manual_seed(1)
model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).cuda().eval()
compiled = vgraph_compile.encoder(model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa",
                                  call_choice="smallest_bucket", artifact_dir=sys.argv[1])
errors = []
with torch.no_grad():
    for number, lengths in enumerate(json.loads(sys.argv[2])):
        inputs = pack_images(lengths, 12, device="cuda")
        out, ref = compiled(*inputs), model(*inputs)
        errors.append(bool(out.isfinite().all()) and ((out - ref).norm() / ref.norm()).item())
        if number == 0:  # served before its graph was captured: the rest are captured now
            compiled.vgraph.runtimes[0].warmup()
frames = torch._dynamo.utils.counters["frames"]["total"]
print(json.dumps({"counters": counters.snapshot(), "frames": frames, "errors": errors}))
"""


def test_a_second_process_captures_and_replays_the_saved_plan(tmp_path):
    """The child assembles the encoder from the plan and the artifact and serves its first call before any graph
    is captured (the captures run behind it), then captures both buckets' graphs, loads the padding costs the parent
    timed (the same inductor cache) and replays the later calls: no dynamo frame, no trace, no compile, no timing;
    fp32 rows equal eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).cuda().eval()
    compiled = vgraph_compile.encoder(
        model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa", artifact_dir=str(tmp_path),
        call_choice="smallest_bucket",
    )
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12, device="cuda"))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path), json.dumps(CALLS)],
        capture_output=True, text=True, cwd=ROOT, env=environment, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    moved = {name: value for name, value in report["counters"].items() if value}
    assert moved == dict(
        plans_loaded=1, artifacts_loaded=1, padding_costs_loaded=1, buckets_built=2, graphs_captured=2,
        graphs_uploaded=2, served_before_capture=1, replays=2,
    )
    assert report["frames"] == 0
    assert all(error is not False and error <= 1e-5 for error in report["errors"]), report["errors"]


def test_keyed_tower_calls_replay_with_staged_metadata_and_aligned_weights_held_once():
    """A toy Qwen2.5-VL tower (MLP width 58, aligned to 64) on CUDA graphs: calls of two grids, alternating, each
    replayed and equal to the stock tower; the down projections are strided views of the graphs' padded weights."""
    from vgraph_compile.hf import compile_vision_tower, routed_attention
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    torch._dynamo.reset()
    sizes = {**TOY_SIZES["qwen2.5-vl"], "intermediate_size": 58}
    tower = qwen_tower("qwen2.5-vl", device="cuda", dtype=torch.float32, **sizes)
    served = compile_vision_tower(
        tower, token_budgets=[128, 512], max_items=3, max_frames=6, call_choice="smallest_bucket"
    )
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grids = [torch.tensor([[1, 8, 12], [1, 4, 4]]), torch.tensor([[1, 16, 8]])]
    inputs = [(torch.randn(int(grid.prod(-1).sum()), width, device="cuda"), grid) for grid in grids]
    with torch.no_grad():
        served.warmup()
        with counters.expect(replays=4):
            outputs = [served(*inputs[index]) for index in (0, 1, 0, 1)]
        with routed_attention(tower):
            references = [tower(pixel_values, grid.cuda()) for pixel_values, grid in inputs]
    for index, out in zip((0, 1, 0, 1), outputs):
        torch.testing.assert_close(out.pooler_output, references[index].pooler_output, rtol=1e-4, atol=1e-4)
    down = tower.blocks[0].mlp.down_proj.weight
    assert tuple(down.shape) == (32, 58) and down.stride() == (64, 1)
