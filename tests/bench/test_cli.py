import json

import pytest
import torch

from vgraph_compile.bench.cli import main
from vgraph_compile.bench.targets import TARGETS

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)


TOY_ARGS = [
    "--device", "cpu", "--tower", "qwen2-vl", "--resize", "depth=1", "embed_dim=32", "num_heads=2", "hidden_size=48",
    "mlp_ratio=2", "--requests", "1", "--seed", "28", "--cases", "1x224^2", "--repeats", "1", "--host-calls", "3",
    "--compile-backend", "eager",
]  # fmt: skip
"""A one-block, width-32 Qwen2-VL tower on the CPU; the first request of seed 28 is one image of 792 patches."""


def test_cpu_run_measures_every_system_and_stores_targets(tmp_path):
    """The whole harness on the CPU: every system ends ok or (reduce-overhead) refuses for want of CUDA; host
    time, the vgraph counters and the targets land in the JSON."""
    path = tmp_path / "report.json"
    systems = ["hf_eager_sdpa", "torch_compile_routed", "torch_compile_reduce_overhead", "exact_shape_oracle", "vgraph"]
    options = ["compiler=eager", "attention_backend=sdpa", "token_budgets=[256,1024]"]
    main([*TOY_ARGS, "--systems", *systems, "--vgraph-option", *options, "--targets", "--json", str(path)])
    report = json.loads(path.read_text())
    status = {name: row["status"] for name, row in report["systems"].items()}
    assert status == {
        **dict.fromkeys(systems, "ok"),
        "torch_compile_reduce_overhead": status["torch_compile_reduce_overhead"],
    }
    assert status["torch_compile_reduce_overhead"].startswith("needs CUDA")
    for name in ("hf_eager_sdpa", "torch_compile_routed", "exact_shape_oracle", "vgraph"):
        assert report["systems"][name]["host_ms_per_call_p50"] > 0 and report["cases"]["1x224^2"][name] > 0
    # one dynamo trace, one compile for both budgets (256 and 1024; compiler=eager counts none), no graph on the CPU
    moved = report["systems"]["vgraph"]["vgraph_counters"]
    assert (moved["traces"], moved["buckets_built"], moved["compiles"], moved["graphs_captured"]) == (1, 2, 0, 0)
    assert [row["measure"] for row in report["targets"]] == [target.measure for target in TARGETS]
    assert {row["measure"]: row["measured"] for row in report["targets"]}["re-records after warm-up, vgraph"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_before_building_anything():
    with pytest.raises(SystemExit, match="no CUDA GPU is visible: run it on a machine with one"):
        main(["--systems", "vgraph"])
