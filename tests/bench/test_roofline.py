"""benchmarks/roofline.py: a roofline row equals a hand count of a tiny windowed tower; the mix's totals and the
cases and requests below stock, from hand-made rows; the profile split; the install it is told against the one it
finds; and one toy run on the CPU (a windowed packed tower, a tower served on images only, then a tile tower added
to the same report): every case and mix request timed with its route and kernels, the video of the images-only tower
skipped with the reason, the profile, and every JSON field."""

import argparse
import json

import pytest
import torch

from tests.helpers import benchmark_script
from vgraph_compile.bench.flops import FlopSplit, tower_flop_split
from vgraph_compile.bench.install import PACKAGES

pytestmark = pytest.mark.heavy  # one toy run of three towers: a worker takes this module first (conftest.py)

pytest.importorskip("transformers", minversion="5.23")


@pytest.fixture(scope="module")
def script():
    return benchmark_script("roofline")


def attention(lengths: list[int], width: int) -> int:
    return 4 * sum(length * length for length in lengths) * width


def test_a_roofline_row_equals_a_hand_count_of_a_tiny_windowed_tower(script):
    """Qwen2.5-VL shrunk as in test_flops.py (width 32, block 0 windowed, block 1 full): a 1 x 8 x 12 patch grid
    attends in windows of 64 and 32 patches, then over all 96; the linear layers are everything else counted. The
    roofline is attention at 500 TFLOP/s plus the rest at 650, and each time is divided by it."""
    from vgraph_compile.sample_models.vision_utils_towers import build_tower

    tower = build_tower("qwen2_5_vl", tiny=True)
    split = tower_flop_split(tower, [(1, 8, 12)])
    assert split.attention == attention([64, 32], 32) + attention([96], 32)
    patches, width = 96, 32
    block_linears = 2 * patches * width * (3 * width + width + 3 * 64)  # qkv, proj, gated MLP (gate, up, down)
    merger = 2 * 24 * 4 * width * (4 * width + 48)
    assert split.linear == 2 * patches * (3 * 2 * 14 * 14) * width + 2 * block_linears + merger
    row = script.roofline_row(split, stock_ms=3.0, vgraph_ms=1.5)
    roofline = split.attention / 500e9 + split.linear / 650e9  # FLOPs / (TFLOP/s * 1e12) * 1e3 ms
    assert row["flops"] == {"attention": split.attention, "linear": split.linear, "total": split.total}
    assert row["roofline_ms"] == pytest.approx(roofline, rel=1e-4)
    assert row["stock_over_roofline"] == pytest.approx(3.0 / roofline, rel=1e-3)
    assert row["vgraph_over_roofline"] == pytest.approx(1.5 / roofline, rel=1e-3)
    assert row["speedup"] == 2.0


def _row(stock_ms: float, vgraph_ms: float, roofline_ms: float, route: str = "replay") -> dict:
    return {"stock_ms": stock_ms, "vgraph_ms": vgraph_ms, "roofline_ms": roofline_ms, "patches": 100,
            "speedup": round(stock_ms / vgraph_ms, 3), "route": {route: 2}}  # fmt: skip


def test_a_call_at_its_exact_size_is_counted_so_with_the_kernel_it_resolved(script):
    """A tower told to run every call at its exact size: no bucket replayed, both calls of the case (the untimed one
    and the timed one) counted as exact size, and the kernel named is the one its attention resolved (on the CPU,
    the fixed rule's SDPA reference)."""
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.vision_utils_towers import build_tower

    tower = build_tower("qwen2_vl", tiny=True)
    served = compile_vision_tower(
        tower, max_items=8, max_frames=16, call_choice="exact_size", compiler="eager", min_tokens=64, max_tokens=1024
    )
    args = argparse.Namespace(repeats=1, warmup=1, device="cpu")
    grid = torch.tensor([[1, 8, 12]])
    pixels = torch.randn(96, *served.interface.pixel_shape)
    with torch.inference_mode():
        served.warmup()
        row = script.measure(lambda: tower(pixels, grid), lambda: served(pixels, grid), served, FlopSplit(1, 1),
                             "pooler_output", args)  # fmt: skip
    assert (row["route"], row["buckets"], row["kernels"]) == ({"exact size": 2}, [], {"exact size": "sdpa"})
    assert row["rel_error_vs_stock"] < 1e-5


def test_mix_totals_sum_the_requests_and_list_those_below_stock(script):
    rows = [_row(10.0, 4.0, 2.0), _row(6.0, 7.5, 3.0, "exact size"), _row(4.0, 2.0, 1.0)]
    total = script.mix_totals(rows)
    assert (total["stock_ms"], total["vgraph_ms"], total["roofline_ms"]) == (20.0, 13.5, 6.0)
    assert total["vgraph_over_roofline"] == 2.25 and total["stock_over_roofline"] == pytest.approx(3.333, abs=1e-3)
    assert total["share_of_stock_removed"] == pytest.approx(1 - 13.5 / 20, abs=1e-3)
    assert total["share_removed_at_roofline"] == pytest.approx(0.7, abs=1e-3)
    assert (total["lowest_speedup"], total["lowest_request"]) == (0.8, 1)
    assert total["below_stock"] == ["request 1: 0.8x"]
    tower = {"cases": {"1x224^2": _row(2.0, 1.0, 0.5), "1x1792^2": _row(9.0, 10.0, 5.0, "stock"),
                       "video": {"skipped": "images only: ..."}}, "mix": {"requests": rows}}  # fmt: skip
    assert script.slower(tower) == ["1x1792^2: 0.9x (stock)", "mix request 1 (100 patches): 0.8x (exact size)"]


def test_profile_split_is_attention_gemm_and_the_rest_of_the_total_with_the_rests_kernels(script):
    breakdown = {
        "device_ms_total": 10.0,
        "by_kind_ms": {"attention": 4.0, "gemm": 3.5, "triton (inductor fused)": 2.0, "other": 0.5},
        "top": [
            {"kernel": "flash_fwd", "kind": "attention", "ms": 4.0, "calls": 32},
            {"kernel": "nvjet_sm90", "kind": "gemm", "ms": 3.5, "calls": 96},
            {"kernel": "triton_poi_fused_gelu", "kind": "triton (inductor fused)", "ms": 2.0, "calls": 32},
            {"kernel": "elementwise_kernel", "kind": "other", "ms": 0.5, "calls": 1},
        ],
    }
    split = script.profile_split(breakdown)
    assert (split["attention_ms"], split["gemm_ms"], split["rest_ms"], split["total_ms"]) == (4.0, 3.5, 2.5, 10.0)
    assert split["top"] == breakdown["top"]
    assert [kernel["kernel"] for kernel in split["rest_top"]] == ["triton_poi_fused_gelu", "elementwise_kernel"]


def test_a_run_told_another_install_stops_before_building_anything(script, monkeypatch):
    monkeypatch.setattr(
        script, "install", lambda: {"install": "plain", "tag": "plain", "importable": {}, "versions": {}}
    )
    monkeypatch.setattr(script, "run_packed", lambda *args: pytest.fail("a tower was built"))
    with pytest.raises(SystemExit, match="--install cuda: this environment is the plain install"):
        script.main(["--toy", "--install", "cuda", "--towers", "qwen2_vl"])


def test_toy_run_times_every_case_and_request_with_its_route_kernels_and_roofline(script, tmp_path):
    path = tmp_path / "roofline.json"
    common = ["--toy", "--requests", "3", "--repeats", "1", "--warmup", "1", "--json", str(path)]
    script.main(["--towers", "qwen2_5_vl", "glm4v", *common])
    report = script.main(["--towers", "internvit-448", "--add", *common])  # added to the same report
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert list(report["towers"]) == ["qwen2_5_vl", "glm4v", "internvit-448"]
    assert report["roofline"] == {"attention_tflops": 500.0, "linear_tflops": 650.0}
    assert report["install"] in ("plain", "GPU install") or report["install"].startswith("partial")
    assert set(report["versions"]) == set(PACKAGES) and report["device_tag"] == "cpu" and report["date"]
    assert report["settings"]["requests"] == 3 and report["skipped"] == {}

    windowed, images_only, tiles = (report["towers"][name] for name in ("qwen2_5_vl", "glm4v", "internvit-448"))
    assert list(windowed["cases"]) == list(script.PACKED_CASES) == list(images_only["cases"])
    video = images_only["cases"]["video 16f 336^2"]
    assert video["skipped"].startswith("images only: ")
    assert list(tiles["cases"]) == ["N=1", "N=4", "N=13"]
    assert len(windowed["mix"]["requests"]) == 3 and windowed["mix"]["seed"] == 0

    rows = [row for tower in report["towers"].values() for row in tower["cases"].values() if "skipped" not in row]
    rows += [row for tower in (windowed, images_only) for row in tower["mix"]["requests"]]
    for row in rows:
        split = FlopSplit(row["flops"]["attention"], row["flops"]["linear"])
        assert split.attention > 0 and split.linear > 0 and row["flops"]["total"] == split.total
        assert row["roofline_ms"] == pytest.approx(split.roofline_ms, rel=1e-4)
        assert row["stock_ms"] > 0 and row["vgraph_ms"] > 0
        # rounded to 3 decimals: a slow vgraph row (speedup 0.037 on a loaded machine) is off by the rounding alone
        assert row["speedup"] == pytest.approx(row["stock_ms"] / row["vgraph_ms"], rel=1e-2, abs=5e-4)
        assert row["rel_error_vs_stock"] < 1e-4  # fp32, the same ops
        assert set(row["route"]) <= {"replay", "split", "exact size", "stock", "eager", "stock tower",
                                     "several graph calls"}  # fmt: skip
        calls = 1 + 1  # --warmup 1 untimed call, then --repeats 1 timed
        if "several graph calls" in row["route"]:
            assert row["route"]["several graph calls"] == calls and row["route"]["replay"] >= 2 * calls
        else:
            assert sum(row["route"].values()) == calls
        assert row["buckets"] and row["kernels"]
    assert windowed["cases"]["1x1344^2"]["kernels"] == {"group 0": "sdpa", "group 1": "sdpa"}  # windows, full
    assert tiles["cases"]["N=13"]["kernels"] == {"tiles": "sdpa (the tower's own attention over the tile batch)"}
    # request 2 (seed 0) holds a 16-frame video: 8 temporal patches, one item on a video tower, 8 items (one a frame)
    # on the images-only tower, as its model's get_video_features passes them
    assert [t for t, _, _ in windowed["mix"]["requests"][2]["grid"]] == [1, 1, 8]
    assert [t for t, _, _ in images_only["mix"]["requests"][2]["grid"]] == [1] * 10

    total = windowed["mix"]["total"]
    mix = windowed["mix"]["requests"]
    assert total["stock_ms"] == pytest.approx(sum(row["stock_ms"] for row in mix), abs=0.01)
    assert total["lowest_speedup"] == min(row["speedup"] for row in mix)
    below = [f"{name} {line}" for name, tower in report["towers"].items() for line in tower["slower"]]
    assert report["slower"] == below
    assert len(below) == sum(row["speedup"] < 1.0 for row in rows)
    for tower, profiled in ((windowed, ["1x1344^2", "mix request"]), (tiles, ["N=13"])):
        assert [label.rsplit(" ", 1)[0] if label.startswith("mix") else label for label in tower["profile"]] == profiled
        for split in (systems[system] for systems in tower["profile"].values() for system in ("stock", "vgraph")):
            assert split["total_ms"] == pytest.approx(
                split["attention_ms"] + split["gemm_ms"] + split["rest_ms"], abs=2e-3
            )
    table = script.tables([report])
    assert f"| qwen2_5_vl | {report['install']} |" in table and "| glm4v | video 16f 336^2 |" in table
