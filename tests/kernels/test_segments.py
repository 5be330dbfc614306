"""Segment isolation in every attention backend: a NaN or Inf in one segment's q, k or v reaches no other
segment's rows, which equal the run on clean input; rows past the last offset stay exactly zero."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import isolation_case, run_backend, segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import (
    confine_nonfinite_reference,
    confined,
    finish_output_reference,
    segment_ids,
)


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


def check_isolation(name, call, dtype, device, reference_tolerance, head_dim=8):
    """Other segments' rows of the poisoned run are finite and equal the clean run and the float64 reference."""
    lengths, padding, poisoned, tensor, row, value = call
    clean, dirty, cu = isolation_case(
        lengths, padding, poisoned, tensor, row, value, head_dim=head_dim, dtype=dtype, device=device
    )
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


@st.composite
def confinement_cases(draw):
    """k, v and cu_seqlens: segment lengths with empty ones and padding rows, and NaN/Inf planted at several
    entries of k and v (padding rows included)."""
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    rows = sum(lengths) + draw(st.integers(0, 4))
    heads, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    k, v = (torch.randn(rows, heads, head_dim, generator=generator) for _ in range(2))
    if rows:
        entries = st.tuples(
            st.integers(0, 1), st.integers(0, rows - 1), st.integers(0, heads - 1), st.integers(0, head_dim - 1)
        )
        for tensor, row, head, col in draw(st.lists(entries, max_size=5)):
            (k, v)[tensor][row, head, col] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    cu = torch.nn.functional.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return k, v, cu


def expected_poisoned(k, v, cu):
    """Per segment, per head: whether any k or v entry there is non-finite; then a last row, per head, whether any
    segment's is (the rows past the last offset count for neither)."""
    bounds = cu.tolist()
    bad = ~(k.isfinite() & v.isfinite()).all(-1)
    per_segment = torch.stack([bad[start:end].any(0) for start, end in zip(bounds, bounds[1:])])
    return torch.cat([per_segment, per_segment.any(0, keepdim=True)])


@given(case=confinement_cases())
def test_confine_nonfinite_zeroes_nonfinite_entries_and_flags_their_segments(case):
    """Finite entries pass bit for bit, non-finite ones become 0, and exactly the segments (and heads) holding
    one are flagged; empty segments and the padding rows never are."""
    k, v, cu = case
    confined_k, confined_v, poisoned = confine_nonfinite_reference(k, v, cu)
    for before, after in ((k, confined_k), (v, confined_v)):
        assert torch.equal(after, torch.where(before.isfinite(), before, torch.zeros_like(before)))
    assert torch.equal(poisoned, expected_poisoned(k, v, cu))


def check_finished(finished, out, cu, poisoned):
    """NaN on every row of a flagged segment in the flagged head, exact zeros on the rows past the last offset,
    every other entry of ``out`` unchanged, bit for bit."""
    end = int(cu[-1])
    rows_flagged = poisoned[:-1][segment_ids(cu, end)].unsqueeze(-1).expand_as(out[:end])
    assert finished[:end][rows_flagged].isnan().all()
    assert torch.equal(finished[:end][~rows_flagged], out[:end][~rows_flagged])
    assert finished[end:].eq(0).all()


@given(case=confinement_cases())
def test_finish_output_marks_poisoned_rows_and_zeroes_padding_rows(case):
    k, v, cu = case
    poisoned = expected_poisoned(k, v, cu)
    out = torch.randn(k.shape)
    out[int(cu[-1]) :] = float("nan")
    check_finished(finish_output_reference(out, cu, poisoned), out, cu, poisoned)
    check_finished(finish_output_reference(out, cu), out, cu, torch.zeros_like(poisoned))


@given(call=poisoned_calls())
def test_confined_kernel_is_nan_in_the_poisoned_segment_only(call):
    """Through ``confined``: outside the poisoned segment the output equals the kernel's on clean input. Inside
    it, a non-finite k or v entry makes the segment's rows NaN in that entry's head (even where eager attention
    happens to stay finite, such as an Inf key of a one-row segment)."""
    lengths, padding, poisoned, tensor, row, value = call
    clean, dirty, cu = isolation_case(lengths, padding, poisoned, tensor, row, value)
    kernel = confined(lambda q, k, v, cu_seqlens, max_seqlen, scale: q + k + v)
    out, expected = kernel(*dirty, cu, max(lengths), None), kernel(*clean, cu, max(lengths), None)
    start, end = int(cu[poisoned]), int(cu[poisoned + 1])
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[start:end] = False
    others[int(cu[-1]) :] = False
    assert torch.equal(out[others], expected[others])
    assert out[int(cu[-1]) :].eq(0).all(), "rows past the last offset are exact zeros"
    if tensor != 0:
        assert out[start:end, row % out.shape[1]].isnan().all()
