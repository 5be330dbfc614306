"""Bucket buffers: one flat storage per copied token input and one byte storage for the metadata, shared by
every bucket; filled as an empty call for capture."""

import torch

import vgraph_compile
from vgraph_compile.compile.buckets import STAGE_ALIGNMENT
from vgraph_compile.serve import fills
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
from vgraph_compile.spec import Role


def _buckets(budgets):
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(model, token_budgets=budgets, max_segments=4, compiler="eager")
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
    runtime = compiled.vgraph.runtimes[0]
    return runtime.buckets, runtime.encoder.roles


def test_buckets_share_one_storage_per_token_input_and_one_for_the_metadata():
    """A token buffer is a contiguous view of the first elements of its input's storage, sized by the largest
    bucket; the metadata buffers (cu_seqlens here) are typed views into one byte storage, each at a multiple of
    STAGE_ALIGNMENT bytes, inside its bucket's region, which starts the storage."""
    buckets, roles = _buckets((16, 32, 64))
    for index in buckets[0].buffers:
        views = [bucket.buffers[index] for bucket in buckets]
        assert len({view.untyped_storage().data_ptr() for view in views}) == 1
        assert all(view.is_contiguous() for view in views)
        if roles[index] is Role.TOKENS:
            assert all(view.storage_offset() == 0 for view in views)
            assert views[-1].untyped_storage().nbytes() == views[-1].numel() * views[-1].element_size()
            continue
        for bucket, view in zip(buckets, views):
            start = view.storage_offset() * view.element_size()
            assert start % STAGE_ALIGNMENT == 0 and bucket.region.storage_offset() == 0
            assert start + view.numel() * view.element_size() <= bucket.region.numel()
            assert view.untyped_storage().data_ptr() == bucket.region.untyped_storage().data_ptr()
    assert sorted(role.value for role in roles.values()) == ["segment_offsets", "tokens"]
    assert [tuple(bucket.buffers[min(bucket.buffers)].shape) for bucket in buckets] == [(16, 12), (32, 12), (64, 12)]


def test_buffers_take_the_bytes_of_the_largest_bucket_only():
    """Five buckets' buffers hold, all together, exactly the bytes of the largest bucket's token buffers and its
    metadata region."""
    buckets, roles = _buckets((16, 24, 32, 48, 64))
    storages = {
        buffer.untyped_storage().data_ptr(): buffer.untyped_storage().nbytes()
        for bucket in buckets
        for buffer in bucket.buffers.values()
    }
    largest = buckets[-1]
    tokens = sum(b.numel() * b.element_size() for i, b in largest.buffers.items() if roles[i] is Role.TOKENS)
    assert len(buckets) == 5 and sum(storages.values()) == tokens + largest.region.numel()


def test_empty_fill_is_a_valid_call_with_no_tokens():
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    compiled = vgraph_compile.encoder(model, token_budgets=(16,), max_segments=4, compiler="eager")
    with torch.no_grad():
        compiled(*pack_images([5, 7], 12))
    runtime = compiled.vgraph.runtimes[0]
    bucket = runtime.buckets[0]
    for buffer in bucket.buffers.values():
        buffer.fill_(float("nan") if buffer.is_floating_point() else 9)
    fills.empty_bucket(bucket, runtime.encoder.roles)
    roles = runtime.encoder.roles
    for index, buffer in bucket.buffers.items():
        assert buffer.eq(0).all(), roles[index]
    with torch.no_grad():
        (out,) = bucket.run(runtime.encoder.compiled)
    assert out.isfinite().all()  # the NaN written before is gone: every row is a zero row's padding
    torch.testing.assert_close(out, out[:1].expand_as(out))
    assert Role.SEGMENT_OFFSETS in roles.values()
