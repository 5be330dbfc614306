"""The clocks and counters of the benchmarks, on the CPU: wall time around a call, the median after an untimed
warm-up, and the deadline."""

import time

import pytest

from vgraph_compile.bench.timing import check_deadline, elapsed_ms, host_ms_per_call, median_ms


def test_elapsed_ms_on_the_cpu_is_the_wall_time_of_the_call():
    assert 4.0 <= elapsed_ms(lambda: time.sleep(0.005), "cpu") < 500.0


def test_median_ms_runs_the_warmup_untimed_then_the_repeats():
    calls = []
    median = median_ms(lambda: calls.append(None), repeats=5, warmup=2, device="cpu")
    assert len(calls) == 7 and median < 5.0


def test_host_ms_per_call_is_the_median_of_its_calls():
    # a mean would be 100 ms; the median is 50 ms or more only if two of the three calls are held that long
    durations = iter([0.0, 0.0, 0.3])
    assert host_ms_per_call(lambda: time.sleep(next(durations)), calls=3, device="cpu") < 50.0


def test_a_passed_deadline_raises_with_what_was_running():
    check_deadline(time.perf_counter() + 60, "warm-up")
    with pytest.raises(TimeoutError, match="warm-up"):
        check_deadline(time.perf_counter() - 1, "warm-up")
