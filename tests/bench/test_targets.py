from expecttest import assert_expected_inline as assertExpectedInline

from vgraph_compile.bench.targets import targets, targets_table


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
          requests p50, hf_eager_sdpa / vgraph     >= 7         7  pass
   requests p50, torch_compile_routed / vgraph   >= 1.5         2  pass
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
