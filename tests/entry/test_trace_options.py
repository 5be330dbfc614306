"""The trace options: one trace symbolic in every packed dim, whatever the first call's sizes, with feature widths
and float constants fixed."""

import torch
from torch._guards import detect_fake_mode

from vgraph_compile.entry.trace_options import trace_options


def _traced_sizes(fn, *args):
    """The traced shapes of ``fn(*args)``'s tensor inputs (symbols as strings), and the graph's input count."""
    captured = {}

    def capture(gm, example_inputs):
        captured["shapes"] = [
            tuple(str(size) for size in node.meta["example_value"].shape)
            for node in gm.graph.find_nodes(op="placeholder")
            if isinstance(node.meta["example_value"], torch.Tensor)
        ]
        captured["inputs"] = len(example_inputs)
        assert detect_fake_mode(example_inputs) is not None
        return gm.forward

    torch._dynamo.reset()
    with trace_options(args):
        torch.compile(fn, backend=capture, dynamic=True, fullgraph=True)(*args)
    return captured["shapes"], captured["inputs"]


def _scaled_sum(x, y, scale):
    return (x * scale).sum(0) + y.sum(0)


def test_packed_dims_stay_apart_and_symbolic_and_widths_static():
    """Two packed dims equal by chance (8 and 8) get their own symbols, a packed dim of 1 stays symbolic, and the
    trailing width is the traced 4."""
    (x, y), _ = _traced_sizes(_scaled_sum, torch.randn(8, 4), torch.randn(8, 4), 0.5)
    assert x[1] == y[1] == "4"
    assert x[0] != y[0] and not x[0].isdigit() and not y[0].isdigit()
    (x, _), _ = _traced_sizes(_scaled_sum, torch.randn(1, 4), torch.randn(3, 4), 0.5)
    assert not x[0].isdigit()


def test_a_float_argument_is_a_constant_not_a_graph_input():
    _, inputs = _traced_sizes(_scaled_sum, torch.randn(8, 4), torch.randn(5, 4), 0.5)
    assert inputs == 4  # x, y and their two packed sizes; the scale is folded into the graph


def test_the_options_hold_inside_the_block_only():
    before = torch.backends.cuda.cudnn_sdp_enabled(), torch._dynamo.config.specialize_float
    with trace_options():
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch._dynamo.config.specialize_float
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch._dynamo.config.specialize_float) == before
