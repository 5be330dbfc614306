"""The CPU reference of FlashInfer's Q/K/O|V-offset kernel: sequences read at element offsets ``[Q/K/O | V]``, v by
the fused qkv's token stride, and offsets pointing outside q/k/v refused rather than read."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import segment_reference
from vgraph_compile.kernels import qkv_offsets_reference
from vgraph_compile.kernels.ops import qkv_offsets_varlen_attention
from vgraph_compile.kernels.segments import cu_seqlens

segment_lists = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6)


@given(lengths=segment_lists, padding=st.integers(0, 8))
def test_qkv_offsets_reference_reads_element_offsets_like_the_kernel(lengths, padding):
    """Q/K/O offsets count heads*head_dim per row, V offsets the fused qkv stride (3x): real rows equal the
    per-segment reference, rows past the last offset are zero."""
    if sum(lengths) + padding == 0:
        padding = 1
    rows = sum(lengths) + padding
    q, k, v = torch.randn(rows, 3, 2, 8).unbind(1)
    cu = cu_seqlens(lengths)
    packed = torch.cat([cu * 16, cu * v.stride(0)])
    out = qkv_offsets_varlen_attention(q.contiguous(), k.contiguous(), v, packed, max(lengths))
    torch.testing.assert_close(out.double(), segment_reference(q, k, v, cu), rtol=1e-5, atol=1e-5)


def _fused(rows):
    q, k, v = torch.randn(rows, 3, 2, 8).unbind(1)
    return q.contiguous(), k.contiguous(), v


def test_offsets_past_the_tensors_are_refused_before_reading():
    q, k, v = _fused(6)
    past_the_end = torch.tensor([0, 16 * 7, 0, 48 * 7], dtype=torch.int32)  # 7 rows of 6
    message = r"Q/K/O\|V offsets of sequence 0 point outside q/k/v .*pad each half by its own"
    with pytest.raises(ValueError, match=message):
        qkv_offsets_reference.attention(q, k, v, past_the_end, 7, None)


def test_v_offsets_counted_in_q_rows_read_the_wrong_v_rows():
    """V steps by the fused qkv's row (48 elements), not q's (16): V offsets counted in q rows make sequence 1 of
    [4, 4] read v rows of sequence 0, and its output differs from the reference (wrong offsets never pass)."""
    q, k, v = _fused(8)
    cu = cu_seqlens([4, 4])
    right = torch.cat([cu * 16, cu * v.stride(0)])
    wrong = torch.cat([cu * 16, cu * 16])
    expected = segment_reference(q, k, v, cu)
    out = qkv_offsets_reference.attention(q, k, v, right, 4, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(qkv_offsets_reference.attention(q, k, v, wrong, 4, None)[4:].double(), expected[4:])
