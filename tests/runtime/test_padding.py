import torch
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.passes.spec import Role
from vgraph_compile.runtime.padding import fill


@given(rows=st.integers(1, 20), extra=st.integers(0, 20))
def test_rules_overwrite_a_poisoned_buffer(rows, extra):
    """Each rule writes every element: real rows copied, the tail padded by the role, nothing left over."""
    tokens = torch.randn(rows, 3)
    buffer = torch.full((rows + extra, 3), float("nan"))
    fill(Role.TOKENS, buffer, tokens)
    assert torch.equal(buffer[:rows], tokens) and torch.equal(buffer[rows:], torch.zeros(extra, 3))

    offsets = torch.arange(rows + 1, dtype=torch.int32) * 3
    buffer = torch.full((rows + 1 + extra,), -7, dtype=torch.int32)
    fill(Role.SEGMENT_OFFSETS, buffer, offsets)
    assert buffer.tolist() == offsets.tolist() + [3 * rows] * extra

    permutation = torch.randperm(rows)
    buffer = torch.full((rows + extra,), -1, dtype=torch.int64)
    fill(Role.GATHER_INDEX, buffer, permutation)
    assert sorted(buffer.tolist()) == list(range(rows + extra)), "still a permutation: padded rows stay padded"

    buffer = torch.full((rows + extra,), -1, dtype=torch.int64)
    fill(Role.TABLE_INDEX, buffer, permutation)
    assert buffer[rows:].eq(0).all()


def test_two_padded_dims():
    value = torch.ones(2, 3)
    buffer = torch.full((4, 5), float("nan"))
    fill(Role.TOKENS, buffer, value)
    assert buffer.sum() == 6 and not buffer.isnan().any()
