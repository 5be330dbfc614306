"""The dense kernels: one SDPA call over every row, segments kept apart by separation columns (CPU flash kernel)."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import segment_reference
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.dense import separation_columns
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.kernels.segments import cu_seqlens


def _packed(lengths, padding, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(lengths) + padding
    q, k, v = (torch.randn(rows, 2, head_dim, generator=generator).to(dtype) for _ in range(3))
    return q, k, v, cu_seqlens(lengths)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=9),
    padding=st.integers(0, 12),
    head_dim=st.sampled_from([8, 12, 72]),
    scale=st.sampled_from([None, 0.3]),
)
def test_dense_matches_per_segment_reference(lengths, padding, head_dim, scale):
    """Real rows equal per-segment attention (empty segments and padding rows included); padding rows are zero."""
    if sum(lengths) + padding == 0:
        padding = 1
    q, k, v, cu = _packed(lengths, padding, head_dim)
    out = varlen_attention(q, k, v, cu, max(lengths), scale=scale, backend="dense_flash")
    torch.testing.assert_close(out.double(), segment_reference(q, k, v, cu, scale), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[sum(lengths) :], torch.zeros_like(out[sum(lengths) :]))


def test_separation_columns_add_zero_within_a_segment_and_minus_c_squared_across():
    cu = cu_seqlens([2, 0, 3])
    q, k = separation_columns(cu, 7, torch.float32)  # rows 5, 6 are padding: an id of their own
    scores = q @ k.T
    ids = torch.tensor([0, 0, 2, 2, 2, 3, 3])
    same = ids[:, None] == ids[None, :]
    assert torch.equal(scores[same], torch.zeros_like(scores[same]))
    assert (scores[~same] <= -(2.0**120)).all()


def test_nan_in_one_segment_or_the_padding_leaves_the_others_bit_identical():
    """A NaN in segment 1's k poisons segment 1 only; NaN in the padding rows reaches no real row."""
    q, k, v, cu = _packed([5, 7, 4], padding=4, head_dim=16)
    clean = varlen_attention(q, k, v, cu, 7, backend="dense_flash")
    k[6, 1, 3] = float("nan")
    for t in (q, k, v):
        t[16:] = float("nan")
    poisoned = varlen_attention(q, k, v, cu, 7, backend="dense_flash")
    torch.testing.assert_close(poisoned[:5], clean[:5], rtol=0, atol=0)
    torch.testing.assert_close(poisoned[12:16], clean[12:16], rtol=0, atol=0)
    assert poisoned[5:12, 1].isnan().all() and torch.equal(poisoned[5:12, 0], clean[5:12, 0])
    assert torch.equal(poisoned[16:], torch.zeros_like(poisoned[16:]))


def test_bf16_one_large_segment_with_padding_matches_its_reference():
    """One image in a padded bucket (the case the dense kernels are for), in bf16: the padding adds nothing."""
    q, k, v, cu = _packed([200], padding=56, head_dim=72, dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, cu, 200, backend="dense_flash")
    reference = segment_reference(q, k, v, cu)
    torch.testing.assert_close(out[:200].double(), reference[:200], rtol=2e-2, atol=2e-2)


def test_too_many_segments_for_one_dense_call_is_refused():
    q, k, v, cu = _packed([1] * 300, padding=0, head_dim=240)
    with pytest.raises(ValueError, match="too many segments"):
        varlen_attention(q, k, v, cu, 1, backend="dense_flash")


def test_a_per_bucket_choice_picks_by_rows_and_one_segment_calls_by_their_own_entries():
    cpu, f32 = torch.device("cpu"), torch.float32
    name = registry.by_rows({4096: "sdpa", 512: "dense_flash", 16384: "dense_flash"})
    assert name == "512:dense_flash;4096:sdpa;16384:dense_flash"
    assert registry.by_rows({64: "sdpa", 128: "sdpa"}) == "sdpa"
    assert registry.by_rows({64: "sdpa", 128: "sdpa"}, {64: "sdpa", 128: "sdpa"}) == "sdpa"
    assert [registry.resolve(name, cpu, f32, rows).name for rows in (100, 512, 513, 4096, 9000, 20000)] == [
        "dense_flash", "dense_flash", "sdpa", "sdpa", "dense_flash", "dense_flash"
    ]
    assert registry.kernel_names(name) == ("dense_flash", "sdpa", "dense_flash")
    q, k, v, cu = _packed([3, 5], padding=2, head_dim=8)
    torch.testing.assert_close(
        varlen_attention(q, k, v, cu, 5, backend=name), varlen_attention(q, k, v, cu, 5, backend="sdpa")
    )
    split = registry.by_rows({512: "sdpa", 4096: "sdpa"}, {512: "sdpa", 4096: "dense_flash"})
    assert split == "512:sdpa;4096:sdpa;1x512:sdpa;1x4096:dense_flash"
    assert [registry.pick(split, rows, 1) for rows in (100, 600, 9000)] == ["sdpa", "dense_flash", "dense_flash"]
    assert [registry.pick(split, rows, 2) for rows in (100, 600, 9000)] == ["sdpa", "sdpa", "sdpa"]
    assert registry.pick(split, 600) == "sdpa"  # segments unknown: the entries for any call
    assert registry.kernel_names(split) == ("sdpa", "sdpa", "sdpa", "dense_flash")
    assert registry.has_one_segment_entries(split) and not registry.has_one_segment_entries(name)
    assert not registry.has_one_segment_entries("sdpa")


@pytest.mark.parametrize("name", ["1x512:sdpa", "512:sdpa;1y9:sdpa", "512:"])
def test_a_malformed_per_bucket_choice_is_refused(name):
    with pytest.raises(ValueError, match="per-bucket choice"):
        registry.kernel_names(name)


def test_the_op_takes_the_one_segment_entry_only_for_offsets_of_one_segment(monkeypatch):
    """The op reads the segment count from the offsets' shape: one segment takes the ``1x`` entry, several the
    other (a kernel that records its calls tells which ran)."""
    ran = []
    dense = registry.BACKENDS["dense_flash"]
    monkeypatch.setattr(type(dense), "load", lambda backend: _recording(backend.name, ran), raising=True)
    name = registry.by_rows({64: "sdpa"}, {64: "dense_flash"})
    q, k, v, one = _packed([20], padding=4, head_dim=8)
    varlen_attention(q, k, v, one, 20, backend=name)
    _, _, _, two = _packed([10, 10], padding=4, head_dim=8)
    varlen_attention(q, k, v, two, 10, backend=name)
    assert ran == ["dense_flash", "sdpa"]


def _recording(name, ran):
    kernel = importlib.import_module(f"vgraph_compile.kernels.{registry.BACKENDS[name].module or name}")
    function = getattr(kernel, registry.BACKENDS[name].function)

    def run(*args):
        ran.append(name)
        return function(*args)

    return run
