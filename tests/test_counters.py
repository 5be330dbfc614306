"""``counters.expect``: exactly the named counters move, by exactly the named amounts."""

import pytest

from vgraph_compile.counters import Counters


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
