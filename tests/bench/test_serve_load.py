"""benchmarks/serve_load.py: the mean request's TTFT broken down from the server clock's totals, and the clock
itself on a tiny model (its processor, generate and forward wrapped, its tower hooked), as the server installs it."""

import inspect
import json

import pytest
import torch

from tests.helpers import benchmark_script

serve_load = benchmark_script("serve_load")


def _spans(processor, processor_calls, prefill, prefill_calls, tower, tower_calls):
    return {
        "processor": {"ms": processor, "calls": processor_calls},
        "prefill": {"ms": prefill, "calls": prefill_calls},
        "tower": {"ms": tower, "calls": tower_calls},
    }


def test_breakdown_is_per_request_and_the_rest_is_what_the_spans_leave():
    """Four requests between the readings: 40 ms of processor, 100 of prefill (of which 24 tower, over 8 calls), a
    mean TTFT of 60 ms: per request 10, 25, 6, and 25 left."""
    before = _spans(5.0, 1, 10.0, 1, 3.0, 2)
    after = _spans(45.0, 5, 110.0, 5, 27.0, 10)
    assert serve_load.breakdown(before, after, 60.0) == {"processor": 10.0, "prefill": 25.0, "tower": 6.0, "rest": 25.0}
    assert serve_load.breakdown(before, before, 7.0) == {"processor": 0.0, "prefill": 0.0, "tower": 0.0, "rest": 7.0}


def test_the_clock_times_the_processor_each_generates_first_forward_and_the_tower(tmp_path):
    """A stand-in model whose generate runs three forwards, each calling its tower: one prefill per generate (the
    first forward), every tower call, every processor call; generate still sees the forward's own signature."""

    class Tower(torch.nn.Linear):
        pass

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = Tower(4, 4)

        def forward(self, x, scale=1.0):
            return self.tower(x) * scale

        def generate(self, x):
            assert "scale" in inspect.signature(self.forward).parameters
            return [self(x) for _ in range(3)]

    class Processor:
        def apply_chat_template(self, messages):
            return torch.ones(2, 4)

    model, processor, path = Model(), Processor(), tmp_path / "clock.json"
    clock = serve_load.ServerClock(str(path), cuda=False)
    clock.install(model, processor, model.tower)
    for _ in range(2):
        model.generate(processor.apply_chat_template([]))
    spans = json.loads(path.read_text())
    assert {name: span["calls"] for name, span in spans.items()} == {"processor": 2, "prefill": 2, "tower": 6}
    assert all(span["ms"] > 0 for span in spans.values())
