"""A system's row of the report: latency percentiles from its calls, and the recompiles after warm-up counted."""

import torch

from vgraph_compile.bench.result import AfterWarmup, Result


def test_the_summary_reports_percentiles_of_the_calls_and_the_extra_fields():
    result = Result(latencies_ms=[float(ms) for ms in range(100, 0, -1)], warmup_s=12.34, extra={"buckets": 3})
    summary = result.summary()
    assert (summary["p50_ms"], summary["p99_ms"], summary["mean_ms"]) == (50.5, 100.0, 50.5)
    assert (summary["requests"], summary["warmup_s"], summary["buckets"]) == (100, 12.3, 3)
    assert "host_ms_per_call_p50" not in summary


def test_a_system_with_no_calls_reports_no_percentiles():
    summary = Result(status="refused: needs CUDA").summary()
    assert "p50_ms" not in summary and summary["requests"] == 0 and summary["status"] == "refused: needs CUDA"


def test_after_warmup_counts_the_dynamo_graphs_compiled_since_it_started():
    result = Result()
    after = AfterWarmup()
    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    after.stop(result)
    assert result.recompiles == 1 and result.rerecords == 0
