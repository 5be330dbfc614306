import json

from vgraph_compile.bench.report import merge, table


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
