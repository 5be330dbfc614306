"""The example encoders in eager mode: each image's rows depend on that image alone (CLS and register rows
included), the placed CLS rows give ``ClsViT``'s outputs, and the windowed encoder puts its rows back in the
caller's order. (Compiled against eager: ``serve/test_runtime.py``, ``test_cold_start.py``.)"""

import pytest
import torch

from vgraph_compile.kernels.segments import cu_seqlens as cu_seqlens_of
from vgraph_compile.sample_models.packed_vit import (
    ClsViT,
    PackedViT,
    PlacedClsViT,
    RegisterViT,
    WindowedViT,
    pack_images,
    place_cls_rows,
)

LENGTHS = [3, 5, 2]
SIZES = dict(patch_dim=6, dim=8, depth=2, heads=2, out_dim=4)


def _tiny(model_class, **kwargs):
    torch.manual_seed(0)
    return model_class(**SIZES, **kwargs).double().eval()


def test_pack_images_packs_rows_with_their_offsets_and_longest_image():
    patches, cu_seqlens, max_seqlen = pack_images(LENGTHS, 6, dtype=torch.float64)
    assert patches.shape == (10, 6) and patches.dtype == torch.float64
    assert cu_seqlens.tolist() == [0, 3, 8, 10] and cu_seqlens.dtype == torch.int32 and max_seqlen == 5


def test_place_cls_rows_puts_one_cls_row_before_each_images_patches():
    _, cu_seqlens, max_seqlen, cls_rows, patch_rows = place_cls_rows(LENGTHS, 6)
    assert cu_seqlens.tolist() == [0, 4, 10, 13] and max_seqlen == 6
    assert cls_rows.tolist() == [0, 4, 10]
    assert sorted(cls_rows.tolist() + patch_rows.tolist()) == list(range(13))


def _images(patches, lengths):
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    return [patches[start : start + length] for start, length in zip(starts, lengths)]


@pytest.mark.parametrize("model_class", [PackedViT, RegisterViT, ClsViT])
def test_each_images_rows_equal_the_image_encoded_alone(model_class):
    model = _tiny(model_class)
    patches, cu_seqlens, max_seqlen = pack_images(LENGTHS, 6, dtype=torch.float64)
    with torch.no_grad():
        packed = model(patches, cu_seqlens, max_seqlen)
        for index, image in enumerate(_images(patches, LENGTHS)):
            alone = model(image, cu_seqlens_of([len(image)]), len(image))
            start = sum(LENGTHS[:index])
            if model_class is ClsViT:
                torch.testing.assert_close(packed[0][index : index + 1], alone[0])
                torch.testing.assert_close(packed[1][start : start + len(image)], alone[1])
            else:
                torch.testing.assert_close(packed[start : start + len(image)], alone)


def test_placed_cls_rows_give_the_cls_encoders_outputs():
    """``place_cls_rows`` puts each row where ClsViT's graph puts it: with the same weights, the same outputs."""
    cls_model, placed = _tiny(ClsViT), PlacedClsViT(**SIZES).double().eval()
    placed.load_state_dict(cls_model.state_dict())
    patches, cu_seqlens, max_seqlen, cls_rows, patch_rows = place_cls_rows(LENGTHS, 6)
    patches = patches.double()
    with torch.no_grad():
        expected = cls_model(patches, cu_seqlens_of(LENGTHS), max(LENGTHS))
        out = placed(patches, cu_seqlens, max_seqlen, cls_rows, patch_rows)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)


def test_the_windowed_encoder_returns_rows_in_the_callers_order():
    """With full attention in every block, permuting one image's merged rows into windows changes nothing: the
    output equals ``PackedViT``'s (merge 4) with the same weights, row for row."""
    windowed = _tiny(WindowedViT, full_attention_blocks=(0, 1))
    plain = _tiny(PackedViT, merge=4)
    plain.load_state_dict(windowed.state_dict())
    patches, cu_seqlens, max_seqlen = pack_images([16], 6, dtype=torch.float64)
    window_index = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        out = windowed(patches, cu_seqlens, max_seqlen, cu_seqlens, max_seqlen, window_index)
        torch.testing.assert_close(out, plain(patches, cu_seqlens, max_seqlen))
