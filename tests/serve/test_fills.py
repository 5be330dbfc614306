import torch
from hypothesis import given
from hypothesis import strategies as st

from vgraph_compile.spec import Role
from vgraph_compile.serve.fills import RowFills, fill, fill_empty
from vgraph_compile.kernels.segments import cu_seqlens


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


@given(rows=st.integers(1, 20), extra=st.integers(1, 20))
def test_padded_scatter_entries_write_only_padding_rows(rows, extra):
    """A scatter index writes a dim as long as itself: its real entries cover rows [0, rows), its padded entries
    point at rows >= rows (the destination's padding), each once, so scattering through it keeps real rows."""
    index = torch.randperm(rows)
    buffer = torch.full((rows + extra,), -1, dtype=torch.int64)
    fill(Role.SCATTER_INDEX, buffer, index)
    assert torch.equal(buffer[:rows], index) and buffer[rows:].ge(rows).all()
    source = torch.cat([torch.arange(1.0, rows + 1), torch.full((extra,), float("nan"))])
    written = torch.zeros(rows + extra).index_copy(0, buffer, source)
    torch.testing.assert_close(written[index], torch.arange(1.0, rows + 1), rtol=0, atol=0)


def test_two_padded_dims_keep_the_value_in_its_corner():
    """Padded in two dims, the value lands at [:2, :3] and every other element is zero (no NaN left)."""
    value = torch.arange(1.0, 7.0).view(2, 3)
    buffer = torch.full((4, 5), float("nan"))
    fill(Role.TOKENS, buffer, value)
    expected = torch.zeros(4, 5)
    expected[:2, :3] = value
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5), extra=st.integers(1, 40))
def test_packed_halves_padding_keeps_real_rows_and_flat_padding_is_caught(lengths, extra):
    """Padding [Q/K/O | V] offsets half by half (into a capture buffer up to 40 segments larger) leaves every real
    row unchanged and ends each half at its own last offset; padding it as one flat sequence would end the Q/K/O
    half on a V offset."""
    from vgraph_compile.kernels.ops import qkv_offsets_varlen_attention

    tokens = sum(lengths)
    q, k, v = torch.randn(2 * tokens, 3, 2, 4).unbind(1)  # bucket rows: real rows, then padding
    q, k = q.contiguous(), k.contiguous()
    cu = cu_seqlens(lengths)
    packed = torch.cat([cu * 8, cu * v.stride(0)])
    capacity = torch.full((packed.shape[0] + 2 * extra,), -1, dtype=torch.int32)
    real = qkv_offsets_varlen_attention(q, k, v, packed, tokens)[:tokens]

    fill(Role.QKV_OFFSETS, capacity, packed)
    torch.testing.assert_close(qkv_offsets_varlen_attention(q, k, v, capacity, tokens)[:tokens], real, rtol=0, atol=0)

    half = capacity.shape[0] // 2
    assert capacity[:half].tolist() == (cu * 8).tolist() + [8 * tokens] * extra
    assert capacity[half:].tolist() == (cu * v.stride(0)).tolist() + [v.stride(0) * tokens] * extra
    flat = torch.cat([packed, packed[-1:].expand(2 * extra)])
    assert not torch.equal(capacity, flat), "fill padded the offsets as one flat sequence"
    assert capacity[half - 1] == 8 * tokens != flat[half - 1], "flat padding ends the Q/K/O half on a V offset"


@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    more_patches=st.integers(0, 20),
    more_images=st.integers(0, 4),
)
def test_padded_placement_entries_write_distinct_padding_rows(lengths, more_patches, more_images):
    """Patch and CLS rows placed into patches + images rows (``place_cls_rows``), padded into a bucket with more of
    each: every padded entry points past the call's real rows, no two padded entries of one index are equal, all
    stay inside the bucket's destination, and writing NaN through the padded entries keeps every real row."""
    from vgraph_compile.sample_models.packed_vit import place_cls_rows

    patches, _, _, cls_rows, patch_rows = place_cls_rows(lengths, 1)
    written = len(lengths) + sum(lengths)
    capacity = written + more_patches + more_images  # the bucket's destination: its patches + its images
    placed = []
    for index, more in ((patch_rows, more_patches), (cls_rows, more_images)):
        buffer = torch.full((index.shape[0] + more,), -1, dtype=torch.int64)
        fill(Role.PLACEMENT_INDEX, buffer, index, written)
        padded = buffer[index.shape[0] :]
        assert torch.equal(buffer[: index.shape[0]], index)
        assert padded.ge(written).all() and padded.lt(capacity).all() and padded.unique().numel() == more
        placed.append(buffer)
    patch_values = torch.cat([patches[:, 0], torch.full((more_patches,), torch.nan)])
    cls_values = torch.cat([-torch.ones(len(lengths)), torch.full((more_images,), torch.nan)])
    rows = torch.zeros(capacity).index_copy(0, placed[0], patch_values).index_copy(0, placed[1], cls_values)
    torch.testing.assert_close(rows[patch_rows], patches[:, 0], rtol=0, atol=0)
    assert rows[cls_rows].eq(-1).all() and not rows[:written].isnan().any()


def test_an_empty_call_points_placement_padding_at_the_first_rows():
    """A capture's empty call: no real rows, so the padded entries are rows 0, 1, ... of the destination."""
    buffer = torch.full((5,), -1, dtype=torch.int64)
    fill_empty(Role.PLACEMENT_INDEX, buffer)
    assert buffer.tolist() == [0, 1, 2, 3, 4]


@given(
    rows=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    extra=st.integers(0, 12),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.int32]), min_size=4, max_size=4),
    repeat=st.booleans(),
)
def test_batched_row_fills_equal_the_rules_on_poisoned_buffers(rows, extra, dtypes, repeat):
    """``RowFills`` over several buffers of mixed dtypes (one copy launch and one zero launch for all, over byte
    views), with a staged byte copy beside them, writes every element as ``fill`` does, whatever the buffers held;
    a second fill of fewer rows into the same buffers (re-poisoned) through the same view cache still does."""
    views: dict = {}
    buffers = [torch.empty(count + extra, 3).to(dtype) for count, dtype in zip(rows, dtypes)]
    for attempt in range(2 if repeat else 1):
        batch, expected = RowFills(views), []
        for index, (count, buffer) in enumerate(zip(rows, buffers)):
            count = max(0, count - attempt)
            value = (torch.randn(count, 3) * 100).to(buffer.dtype)
            buffer.fill_(float("nan") if buffer.is_floating_point() else -7)
            reference = buffer.clone()
            fill(Role.TOKENS, reference, value)
            assert batch.add(index, buffer, value)
            expected.append(reference)
        staged, region = torch.randint(0, 255, (64,), dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        batch.add_copy(region, staged)
        batch.run()
        for buffer, reference in zip(buffers, expected):
            assert torch.equal(buffer, reference)
        assert torch.equal(region, staged)


def test_row_fills_cached_under_inference_mode_write_under_no_grad():
    """A fill under ``torch.inference_mode`` (a server's warm-up) caches byte views that a later fill of as many
    rows under ``no_grad`` (``generate``'s) writes through."""
    views: dict = {}
    buffer = torch.full((6, 3), float("nan"))
    for mode, value in ((torch.inference_mode, torch.ones(4, 3)), (torch.no_grad, torch.full((4, 3), 2.0))):
        with mode():
            batch = RowFills(views)
            assert batch.add(0, buffer, value)
            batch.run()
        assert torch.equal(buffer[:4], value) and torch.equal(buffer[4:], torch.zeros(2, 3))


def test_row_fills_leave_what_they_cannot_view_as_bytes_to_the_rule():
    """A value padded along a later dim, a 0-dim value and one whose last dim is strided are not queued: the
    caller runs the rule (which handles them), and nothing is written by ``run``."""
    batch = RowFills({})
    assert not batch.add(0, torch.zeros(4, 5), torch.ones(2, 3))
    assert not batch.add(1, torch.zeros(()), torch.ones(()))
    assert not batch.add(2, torch.zeros(4, 3), torch.ones(3, 2).t())
    batch.run()
    assert batch.destinations == [] and batch.tails == []
