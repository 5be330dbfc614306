"""Segment isolation in every attention backend: a NaN or Inf in one segment's q, k or v reaches no other
segment's rows, which equal the run on clean input; rows past the last offset stay exactly zero."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import isolation_case, run_backend, segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import confine_nonfinite, segment_ids


def _skip_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    return registry.BACKENDS[name].unavailable(device, dtype)


@st.composite
def poisoned_calls(draw):
    """Segment lengths with 0 and 1 likely, trailing padding rows, and one non-finite value in a non-empty
    segment."""
    lengths = draw(st.lists(st.sampled_from([0, 1, 2, 7, 33, 130]) | st.integers(0, 40), min_size=2, max_size=4))
    if not any(lengths):
        lengths[0] = 1
    poisoned = draw(st.sampled_from([index for index, length in enumerate(lengths) if length]))
    row = draw(st.integers(0, lengths[poisoned] - 1))
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return lengths, draw(st.integers(0, 9)), poisoned, draw(st.integers(0, 2)), row, value


def check_isolation(name, call, dtype, device, reference_tolerance):
    """Other segments' rows of the poisoned run are finite and equal the clean run and the float64 reference."""
    lengths, padding, poisoned, tensor, row, value = call
    clean, dirty, cu = isolation_case(lengths, padding, poisoned, tensor, row, value, dtype=dtype, device=device)
    expected = run_backend(name, *clean, cu, max(lengths))
    out = run_backend(name, *dirty, cu, max(lengths))
    others = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    others[int(cu[poisoned]) : int(cu[poisoned + 1])] = False
    others[int(cu[-1]) :] = False
    assert out[others].isfinite().all(), f"{name}: segment {poisoned}'s {value} reached other segments"
    torch.testing.assert_close(out[others], expected[others], rtol=0, atol=0)
    reference = segment_reference(*(t.double().cpu() for t in clean), cu.cpu())
    torch.testing.assert_close(out[others].double().cpu(), reference[others.cpu()], **reference_tolerance)
    assert out[int(cu[-1]) :].eq(0).all(), "rows past the last offset are exact zeros"


@pytest.mark.parametrize("name", list(registry.BACKENDS))
@given(call=poisoned_calls())
def test_nonfinite_values_stay_in_their_segment(name, call):
    reason = _skip_reason(name, torch.device("cpu"), torch.float32)
    if reason is not None:
        pytest.skip(reason)
    check_isolation(name, call, torch.float32, "cpu", dict(rtol=1e-5, atol=1e-5))


@given(call=poisoned_calls())
def test_confine_nonfinite_spills_into_the_poisoned_segment_only(call):
    """The spill term is exactly zero outside the poisoned segment. Inside it: a non-finite k or v entry makes the
    segment's rows NaN in that entry's head (even where eager attention happens to stay finite, such as an Inf
    key of a one-row segment); q's rows stay the kernel's."""
    lengths, padding, poisoned, tensor, row, value = call
    _, (q, k, v), cu = isolation_case(lengths, padding, poisoned, tensor, row, value)
    ids = segment_ids(cu, q.shape[0])
    finite_k, finite_v, spill = confine_nonfinite(k, v, cu, ids)
    assert finite_k.isfinite().all() and finite_v.isfinite().all()
    start, end = int(cu[poisoned]), int(cu[poisoned + 1])
    assert spill.shape == (q.shape[0], q.shape[1], 1)
    assert spill[:start].eq(0).all() and spill[end:].eq(0).all()
    head = row % q.shape[1]
    expected = torch.zeros_like(spill[start:end])
    if tensor != 0:
        expected[:, head] = float("nan")
    torch.testing.assert_close(spill[start:end], expected, rtol=0, atol=0, equal_nan=True)