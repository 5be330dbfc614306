"""The start-up phase record: each phase holds its own wall time, exclusive of the phases nested in it."""

import time

import pytest

from vgraph_compile.counters import StartupPhases


def test_a_nested_phase_is_counted_under_its_own_name_only():
    """The trace holds a compile: the two phases add up to the wall time of the whole, and the compile's sleep is
    not counted in the trace too."""
    phases = StartupPhases()
    start = time.perf_counter()
    with phases.phase("trace"):
        time.sleep(0.02)
        with phases.phase("compile"):
            time.sleep(0.05)
    whole = time.perf_counter() - start
    seconds = phases.snapshot()
    assert seconds["compile"] >= 0.05 and seconds["trace"] >= 0.02
    assert seconds["trace"] + seconds["compile"] == pytest.approx(whole, abs=0.01)


def test_a_phase_repeated_adds_up():
    phases = StartupPhases()
    for _ in range(2):
        with phases.phase("captures"):
            time.sleep(0.01)
    assert phases.snapshot()["captures"] >= 0.02


def test_an_unknown_phase_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown start-up phase 'tracing': one of \['analyses'"):
        with StartupPhases().phase("tracing"):
            pass
