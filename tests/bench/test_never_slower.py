"""benchmarks/never_slower.py --toy: a packed tower and a tile tower at every case, stock against vgraph with the
choices the measured runtime made, the call_choice mix over every choice, and the kernel split of a profile."""

import json

import pytest

from tests.helpers import benchmark_script

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)

pytest.importorskip("transformers", minversion="5.23")


def test_toy_run_compares_every_case_and_every_call_choice(tmp_path):
    path = tmp_path / "report.json"
    script = benchmark_script("never_slower")
    report = script.main(
        ["--toy", "--towers", "qwen2_vl", "so400m-384", "--mix", "4", "--mix-tower", "qwen2_vl", "--mix-warmup", "1",
         "--repeats", "1", "--warmup", "1", "--json", str(path)]
    )  # fmt: skip
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert list(report["towers"]["qwen2_vl"]["cases"]) == list(script.PACKED_CASES)
    assert list(report["towers"]["so400m-384"]["cases"]) == ["N=1", "N=4", "N=7", "N=13"]
    rows = [row for tower in report["towers"].values() for row in tower["cases"].values()]
    for row in rows:
        assert row["stock_ms"] > 0 and row["vgraph_ms"] > 0 and row["padded_ms"] > 0
        assert sum(row["choices"].values()) == 2  # the warm call and the timed one, each counted once
        assert set(row["choices"]) <= {"padded to the smallest bucket", "split over two buckets",
                                       "compiled code at the exact size", "stock module"}  # fmt: skip
    slower = [row for row in rows if row["speedup"] < 1.0]
    assert len(report["slower"]) == len(slower)
    mix = report["mix"]
    assert list(mix["total_ms"]) == ["smallest_bucket", "exact_size", "stock", "measured"]
    assert mix["choices"]["stock"] == {"stock module": 4} and mix["choices"]["exact_size"] == {
        "compiled code at the exact size": 4
    }
    fixed = {choice: ms for choice, ms in mix["total_ms"].items() if choice != "measured"}
    assert mix["tower"] == "qwen2_vl" and mix["best_fixed"] == min(fixed, key=fixed.get)
    assert mix["measured_over_best_fixed"] == pytest.approx(mix["total_ms"]["measured"] / min(fixed.values()), abs=1e-3)
    assert "budget 1 dropped" in report["towers"]["so400m-384"]["stats"]


def test_kernels_are_split_by_name_attention_first():
    split = benchmark_script("never_slower").kernel_split(
        {
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma": 5.0,
            "pytorch_flash::flash_fwd_kernel<...>": 2.0,
            "sm90_xmma_gemm_bf16bf16_bf16f32": 3.0,
            "nvjet_tst_128x256": 1.0,
            "triton_poi_fused_add_mul_0": 0.5,
        }
    )
    assert split == {"attention": 7.0, "gemm": 4.0, "rest": 0.5}
