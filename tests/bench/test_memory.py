from vgraph_compile.bench.memory import MIB, peak_breakdown


def _alloc(addr, mib, filename, name="f"):
    frames = [{"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": filename, "line": 7, "name": name}]
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": frames}


def test_peak_is_the_most_bytes_live_at_once_grouped_by_own_code():
    trace = [
        _alloc(1, 100, "/x/vgraph_compile/compile/buckets.py", "capture"),
        _alloc(2, 200, "/x/transformers/models/qwen2_vl/modeling_qwen2_vl.py", "forward"),
        {"action": "free_completed", "addr": 1, "size": 100 * MIB},
        _alloc(3, 50, "/x/vgraph_compile/compile/buckets.py", "capture"),
        _alloc(4, 30, "/usr/lib/python3/threading.py"),
        {"action": "free_completed", "addr": 2, "size": 200 * MIB},
        _alloc(5, 40, "/x/vgraph_compile/compile/buckets.py", "capture"),
    ]
    breakdown = peak_breakdown({"device_traces": [trace]})
    assert breakdown["peak_mib"] == 300.0
    assert breakdown["by_origin"] == [
        ["transformers/models/qwen2_vl/modeling_qwen2_vl.py:7 forward", 200.0],
        ["vgraph_compile/compile/buckets.py:7 capture", 100.0],
    ]


def test_a_later_higher_peak_replaces_the_earlier_one():
    trace = [
        _alloc(1, 10, "/x/benchmarks/startup.py"),
        {"action": "free_completed", "addr": 1, "size": 10 * MIB},
        _alloc(2, 20, "/x/elsewhere.py"),
        _alloc(3, 5, "/x/benchmarks/startup.py"),
    ]
    breakdown = peak_breakdown({"device_traces": [trace]})
    assert breakdown["peak_mib"] == 25.0
    assert breakdown["by_origin"] == [["elsewhere", 20.0], ["benchmarks/startup.py:7 f", 5.0]]
