"""``counters.expect``: exactly the named counters move, by exactly the named amounts; the start-up phase record:
each phase holds its own wall time, exclusive of the phases nested in it."""

import time

import pytest

from vgraph_compile.counters import Counters, StartupPhases


def test_expect_passes_when_exactly_the_named_counters_move_by_their_amounts():
    counters = Counters()
    with counters.expect(replays=2, traces=1, compiles=0):
        counters.replays += 2
        counters.traces += 1


@pytest.mark.parametrize(
    "moves, expected, message",
    [
        ({"replays": 1}, {"replays": 2}, r"\{'replays': 1\} != expected \{'replays': 2\}"),
        ({"replays": 1, "eager_fallbacks": 1}, {"replays": 1}, r"'eager_fallbacks': 1.* != expected \{'replays': 1\}"),
        ({}, {"compiles": 1}, r"\{\} != expected \{'compiles': 1\}"),
    ],
    ids=["another amount", "an unnamed counter moved", "a named counter did not move"],
)
def test_expect_fails_when_another_counter_or_amount_moved(moves, expected, message):
    counters = Counters()
    with pytest.raises(AssertionError, match=message):
        with counters.expect(**expected):
            for name, delta in moves.items():
                setattr(counters, name, getattr(counters, name) + delta)


def test_a_snapshot_is_a_copy():
    counters = Counters()
    snapshot = counters.snapshot()
    counters.traces += 1
    assert snapshot["traces"] == 0 and counters.snapshot()["traces"] == 1


def test_a_nested_phase_is_counted_under_its_own_name_only():
    """The trace holds a compile: each phase holds at least its own sleep, and together they hold no more than the
    wall time of the whole (the compile's sleep counted in the trace too would exceed it)."""
    phases = StartupPhases()
    start = time.perf_counter()
    with phases.phase("trace"):
        time.sleep(0.02)
        with phases.phase("compile"):
            time.sleep(0.05)
    whole = time.perf_counter() - start
    seconds = phases.snapshot()
    assert seconds["compile"] >= 0.05 and seconds["trace"] >= 0.02
    assert seconds["trace"] + seconds["compile"] <= whole


def test_a_phase_repeated_adds_up():
    phases = StartupPhases()
    for _ in range(2):
        with phases.phase("captures"):
            time.sleep(0.01)
    assert phases.snapshot()["captures"] >= 0.02


def test_an_unknown_phase_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown start-up phase 'tracing': one of \['analyze'"):
        with StartupPhases().phase("tracing"):
            pass
