"""benchmarks/large_images.py --toy: the So400m-shaped encoder part on the CPU (the tower part is hf_towers.py's
path, tested there): every case served and timed against eager, equal to eager, with its FLOPs counted by hand."""

import json

from tests.helpers import benchmark_script


def test_toy_encoder_run_matches_eager_and_counts_flops(tmp_path):
    path = tmp_path / "report.json"
    script = benchmark_script("large_images")
    report = script.main(["--toy", "--towers", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    cases = report["so400m_encoder"]["cases"]
    assert list(cases) == list(script.ENCODER_CASES)
    for name, case in cases.items():
        lengths = [max(length // 16, 8) for length in script.ENCODER_CASES[name]]  # the toy's 1/16 of each image
        rows = sum(lengths)
        # toy encoder: width 64, 2 blocks, MLP 96, patches of 588: embedding, qkv + proj, MLP, then attention
        hand = 2 * rows * (588 * 64 + 2 * (4 * 64 * 64 + 2 * 64 * 96)) + 2 * 4 * sum(n * n for n in lengths) * 64
        assert case["tokens"] == rows and case["flops"] == hand
        assert case["eager_ms"] > 0 and case["vgraph_ms"] > 0 and case["vgraph_vs_eager_rel_error"] < 1e-2
    assert "attention kernels" in report["so400m_encoder"]["stats"]
