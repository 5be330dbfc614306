"""benchmarks/hf_towers.py --toy: any served family by name, on the CPU; every fixed case timed for the stock tower
and vgraph with vgraph's error against the fp32 tower and a FLOP count, or, for a tower served on images only,
recorded as skipped with the reason; no retrace after warm-up."""

import json

import pytest

from tests.helpers import benchmark_script

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)

pytest.importorskip("transformers", minversion="5.23")


@pytest.mark.parametrize("family, images_only", [("exaone4_5", False), ("kimi_k25", True)])
def test_toy_run_times_every_case_or_skips_videos(tmp_path, family, images_only):
    path = tmp_path / "report.json"
    report = benchmark_script("hf_towers").main([family, "--toy", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert report["tower"] == family and report["retraces"] == 0 and report["device"] == "cpu"
    video = report["cases"].pop("video 16f 336^2")
    assert ("skipped" in video) == images_only
    if images_only:
        assert video["skipped"].startswith("images only: ")
    for case in [video] * (not images_only) + list(report["cases"].values()):
        assert case["hf_eager_sdpa_ms"] > 0 and case["vgraph_ms"] > 0 and case["flops"] > 0
        assert case["vgraph_rel_error"] < 0.05 and case["mfu"] is None  # bf16 against fp32; no peak rate on a CPU
    assert all(vgraph < 0.05 for vgraph, _ in report["errors"])
