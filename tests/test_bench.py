"""vgraph-bench without a GPU: the workload, the FLOP count, merging, the table and the targets, the exact-shape
oracle and the whole harness on a toy tower on the CPU, the second-process warm-up, the refusal without CUDA."""

import json

import pytest
import torch
from expecttest import assert_expected_inline as assertExpectedInline

from vgraph_compile.bench import (
    CASES_PX,
    TARGETS,
    ExactShape,
    HostMetadata,
    cuda_graph_captures,
    main,
    merge,
    table,
    targets,
    targets_table,
    to_grid,
    tower_flops,
    trace,
)
from vgraph_compile.hf.attention import routed_attention


@pytest.fixture(scope="module")
def bench_tower():
    """A two-block, width-32 Qwen2.5-VL tower (windows and a full-attention block) on the CPU."""
    pytest.importorskip("transformers", minversion="5.23")
    from tests.hf.conftest import TOY_SIZES
    from vgraph_compile.models.qwen_towers import qwen_tower

    return qwen_tower("qwen2.5-vl", device="cpu", dtype=torch.float32, **TOY_SIZES["qwen2.5-vl"])


def test_trace_is_seeded_and_within_the_stated_ranges():
    requests = trace(seed=0, requests=64)
    assert requests == trace(seed=0, requests=64) and requests != trace(seed=1, requests=64)
    for items in requests:
        images = [item for item in items if item[0] == 1]
        assert 1 <= len(images) <= 4
        for _, h, w in images:
            assert 224 <= min(h, w) and max(h, w) <= 1344 and max(h, w) / min(h, w) <= 2.0 + 1e-9
    assert any(item[0] > 1 for items in requests for item in items), "some requests carry a video"


def test_to_grid_rounds_to_whole_merged_tokens():
    assert to_grid(CASES_PX["1x224^2"], 14, 2, 2) == [(1, 16, 16)]
    assert to_grid(CASES_PX["video 16f 336^2"], 14, 2, 2) == [(8, 24, 24)]
    assert to_grid([(1, 336, 336)], 16, 2, 2) == [(1, 20, 20)]  # 336 / 32 = 10.5 rounds half to even, as the processor


def test_flops_of_the_qwen25_tower_match_two_per_parameter_and_token():
    pytest.importorskip("transformers", minversion="5.23")
    from vgraph_compile.models.qwen_towers import qwen_tower

    with torch.device("meta"):
        tower = qwen_tower("qwen2.5-vl", device="meta", dtype=torch.float32)
    parameters = sum(p.numel() for p in tower.parameters())
    tokens = 96 * 96
    flops = tower_flops(tower, [(1, 96, 96)])
    assert 2 * parameters * tokens <= flops <= 1.2 * 2 * parameters * tokens  # plus attention, within 20%


def test_merge_and_table(tmp_path):
    base = {"device": "gpu", "torch": "2.x", "model": "m", "workload": {}}
    first = {
        **base,
        "systems": {
            "a": {
                "p50_ms": 1.0,
                "p99_ms": 2.0,
                "mean_ms": 1.5,
                "warmup_s": 1,
                "recompiles": 0,
                "rerecords": 0,
                "peak_mem_gib": 1,
                "status": "ok",
            }
        },
        "cases": {"c": {"a": 1.0}},
    }
    second = {
        **base,
        "systems": {
            "b": {"warmup_s": 9, "recompiles": 0, "rerecords": 0, "peak_mem_gib": 1, "status": "did not finish"}
        },
        "cases": {"c": {"b": 3.0}},
    }
    paths = []
    for index, report in enumerate((first, second)):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(json.dumps(report))
    merged = merge([str(path) for path in paths])
    assert list(merged["systems"]) == ["a", "b"] and merged["cases"] == {"c": {"a": 1.0, "b": 3.0}}
    assert "did not finish" in table(merged)


def _row(**fields):
    return {"warmup_s": 1.0, "recompiles": 0, "rerecords": 0, "peak_mem_gib": 1.0, "status": "ok", **fields}


def test_targets_from_a_hand_made_report():
    """Each target reads its own numbers; a system that did not end ok measures nothing (its zeros prove nothing)."""
    vgraph = _row(p50_ms=20.0, host_ms_per_call_p50=0.2, warmup_s=25.0, rerecords=1, peak_mem_gib=2.0)
    vgraph["second_start_warmup_s"] = 12.0
    report = {
        "systems": {
            "hf_eager_sdpa": _row(p50_ms=140.0),
            "torch_compile_routed": _row(p50_ms=40.0),
            "exact_shape_oracle": _row(),
            "vgraph": vgraph,
        },
        "cases": {
            "1x224^2": {"vgraph": 2.5, "exact_shape_oracle": 2.5},
            "4x336^2": {"vgraph": 8.4, "exact_shape_oracle": 8.0},
        },
    }
    assertExpectedInline(
        targets_table(targets(report, baseline_peak_gib=1.6)),
        """\
                                        target    bound  measured  verdict
             trace p50, hf_eager_sdpa / vgraph     >= 7         7  pass
      trace p50, torch_compile_routed / vgraph   >= 1.5         2  pass
 worst fixed case, vgraph / exact_shape_oracle  <= 1.05      1.05  pass
                            1x224^2 ms, vgraph     <= 3       2.5  pass
                      host ms per call, vgraph  <= 0.15       0.2  FAIL
                        cold warm-up s, vgraph    <= 30        25  pass
              second-process warm-up s, vgraph    <= 10        12  FAIL
              recompiles after warm-up, vgraph     <= 0         0  pass
              re-records after warm-up, vgraph     <= 0         1  FAIL
                peak memory, vgraph / baseline   <= 1.2      1.25  FAIL""",
    )
    report["systems"]["vgraph"]["status"] = "failed: RuntimeError: out of memory"
    verdicts = {row["measure"]: row["pass"] for row in targets(report, baseline_peak_gib=None)}
    assert set(verdicts.values()) == {None}, "every target reads vgraph; none is measured by a failed run"


def test_exact_shape_graph_equals_the_routed_tower_and_serves_its_grid_only(bench_tower):
    """On the CPU the oracle runs its compiled code on its static buffers: equal to the routed eager tower, and a
    second call with other pixels overwrites the buffers rather than reusing the first call's result."""
    tower = bench_tower
    grid = ((1, 8, 8), (2, 4, 8))
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grid_thw = torch.tensor(grid)
    with torch.no_grad():
        exact = ExactShape(tower, grid, HostMetadata(tower, "cpu"), torch.full((128, width), float("nan")), "eager")
        for _ in range(2):
            pixels = torch.randn(128, width)
            with routed_attention(tower):
                ref = tower(pixels, grid_thw)
            pooled, hidden = exact(pixels, grid_thw)
            torch.testing.assert_close(pooled, ref.pooler_output, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"serves grid_thw \[\(1, 8, 8\), \(2, 4, 8\)\] only"):
            exact(torch.randn(64, width), torch.tensor([(1, 8, 8)]))


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
    # one trace, one compile for both budgets (256 and 1024; compiler=eager counts none), no CUDA graph on the CPU
    moved = report["systems"]["vgraph"]["vgraph_counters"]
    assert (moved["traces"], moved["buckets_built"], moved["compiles"], moved["graphs_captured"]) == (1, 2, 0, 0)
    assert [row["measure"] for row in report["targets"]] == [target.measure for target in TARGETS]
    assert {row["measure"]: row["measured"] for row in report["targets"]}["re-records after warm-up, vgraph"] == 0


def test_second_start_runs_the_warmup_again_in_a_fresh_process_with_the_same_cache(tmp_path):
    cache = tmp_path / "inductor"
    report = main(
        [*TOY_ARGS, "--systems", "hf_eager_sdpa", "--warmup-only", "--second-start", "--cache-dir", str(cache)]
    )
    assert report["inductor_cache_dir"] == report["second_start_inductor_cache_dir"] == str(cache)
    assert "second_start_warmup_s" in report["systems"]["hf_eager_sdpa"]
    assert "second_start_status" not in report["systems"]["hf_eager_sdpa"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_before_building_anything():
    with pytest.raises(SystemExit, match="no CUDA GPU is visible: run it on a machine with one"):
        main(["--systems", "vgraph"])


@pytest.mark.gpu
def test_exact_shape_graph_captures_once_and_replays_the_tower(bench_tower):
    """One CUDA graph per oracle; calls replay it (no further capture) and equal the routed tower."""
    tower = bench_tower.cuda()
    grid = ((1, 8, 8), (2, 4, 8))
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grid_thw = torch.tensor(grid)
    with torch.no_grad():
        before = cuda_graph_captures()
        exact = ExactShape(tower, grid, HostMetadata(tower, "cuda"), torch.zeros(128, width, device="cuda"), "eager")
        assert cuda_graph_captures() - before == 1
        for _ in range(3):
            pixels = torch.randn(128, width, device="cuda")
            with routed_attention(tower):
                ref = tower(pixels, grid_thw.cuda())
            torch.testing.assert_close(exact(pixels, grid_thw)[0], ref.pooler_output, rtol=1e-4, atol=1e-4)
        assert cuda_graph_captures() - before == 1
