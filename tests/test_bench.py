"""The parts of vgraph-bench that need no GPU: the workload, the FLOP count, merging and the table."""

import json

import pytest
import torch

from vgraph_compile.bench import CASES_PX, merge, table, to_grid, tower_flops, trace


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
