"""The SDPA reference kernel: a block-diagonal mask in which the padding rows form a block of their own (no fully
masked row, so no NaN from the mask), and the confinement that keeps a NaN in its segment."""

import torch

from tests.helpers import segment_reference
from vgraph_compile.kernels import sdpa
from vgraph_compile.kernels.segments import cu_seqlens

LENGTHS, PADDING = [3, 0, 5], 4


def _packed(generator=None):
    rows = sum(LENGTHS) + PADDING
    return (torch.randn(rows, 2, 8, dtype=torch.float64, generator=generator) for _ in range(3))


def test_the_masked_kernel_attends_per_segment_and_leaves_no_row_fully_masked():
    q, k, v = _packed(torch.Generator().manual_seed(0))
    cu = cu_seqlens(LENGTHS)
    out = sdpa.unconfined(q, k, v, cu, 5, None)
    assert out.isfinite().all()  # the padding rows attend to each other
    torch.testing.assert_close(out[: sum(LENGTHS)], segment_reference(q, k, v, cu)[: sum(LENGTHS)])


def test_a_nan_key_crosses_segments_in_the_masked_kernel_but_not_in_the_confined_one():
    """Why ``attention`` is the confined kernel: masked pairs still multiply, and NaN * 0 is NaN."""
    q, k, v = _packed(torch.Generator().manual_seed(1))
    cu = cu_seqlens(LENGTHS)
    k[0, 0, 0] = float("nan")  # segment 0, head 0
    assert sdpa.unconfined(q, k, v, cu, 5, None)[3:8, 0].isnan().all()
    out = sdpa.attention(q, k, v, cu, 5, None)
    assert out[:3, 0].isnan().all() and out[:3, 1].isfinite().all()
    clean = segment_reference(q, k, v, cu)
    torch.testing.assert_close(out[3:8], clean[3:8])
    assert out[8:].eq(0).all()
