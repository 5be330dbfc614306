"""The analyses' records in the user's terms: dynamo's input names and size symbols never reach a message or a
printed spec. A hand-made spec stands for a trace: a windowed encoder (patches = 4 rows per window) with a CLS row
per image (token rows = patches + images)."""

import pytest
import sympy
from expecttest import assert_expected_inline

from vgraph_compile.spec import AttentionGroup, Binding, BucketShape, InputRole, Role, VarlenSite, VarlenSpec, user_name

PATCHES, WINDOWS, SEGMENTS, MAX_SEQLEN, LIFTED = sympy.symbols("s0 s1 s2 s3 s4", integer=True, positive=True)


def _spec() -> VarlenSpec:
    inputs = (
        InputRole(0, "l_self_modules_embed_parameters_weight_", Role.PARAMETER),
        InputRole(1, "s4", Role.SIZE),
        InputRole(2, "l_patches_", Role.TOKENS, dims=(0,)),
        InputRole(3, "l_window_index_", Role.GATHER_INDEX, dims=(0,), indexed=PATCHES),
        InputRole(4, "l_cu_seqlens_", Role.SEGMENT_OFFSETS, dims=(0,), group=0),
        InputRole(5, "l_max_seqlen_", Role.MAX_SEQLEN, group=0),
    )
    return VarlenSpec(
        inputs=inputs,
        sites=(VarlenSite("attended", 0, PATCHES + SEGMENTS - 1),),
        groups=(AttentionGroup(0, 4, SEGMENTS - 1, (5,), ("attended",), ends_at=PATCHES + SEGMENTS - 1),),
        token_rows=PATCHES + SEGMENTS - 1,
        bindings=(Binding(LIFTED, 1, None), Binding(MAX_SEQLEN, 5, None)),
        input_shapes=(
            (16, 12),
            None,
            (PATCHES, 12),
            (WINDOWS,),
            (SEGMENTS,),
            None,
        ),
        outputs=((PATCHES + SEGMENTS - 1, 8),),
        relations={PATCHES: 4 * WINDOWS},
    )


@pytest.mark.parametrize(
    "traced, written",
    [
        ("l_x_", "x"),
        ("l_self_modules_blocks_modules_0_parameters_weight_", "self.blocks.0.weight"),
        ("l_self_buffers_position_ids_", "self.position_ids"),
        ("cu_seqlens", "cu_seqlens"),
    ],
)
def test_user_name_undoes_dynamos_input_names(traced, written):
    assert user_name(traced) == written


def test_a_symbol_is_described_by_the_tensor_dim_it_sizes_before_a_lifted_int():
    spec = _spec()
    assert spec.describe(PATCHES) == "patches.shape[0]"
    assert spec.describe(MAX_SEQLEN) == "max_seqlen"
    assert spec.describe_expr(4 * WINDOWS + SEGMENTS) == "cu_seqlens.shape[0] + 4*window_index.shape[0]"
    assert spec.describe(sympy.Symbol("s9")) == "s9"  # bound nowhere: its own name


def test_the_printed_spec_names_inputs_and_dims_as_the_user_wrote_them():
    """Lifted sizes and parameters are not listed one by one; no ``s<N>`` symbol or ``l_..._`` name shows."""
    assert_expected_inline(
        _spec().format(),
        """\
tokens: cu_seqlens.shape[0] + patches.shape[0] - 1
relation: patches.shape[0] == 4*window_index.shape[0]
group 0: offsets=cu_seqlens segments=cu_seqlens.shape[0] - 1 sites=['attended']
input patches: tokens dims=[0]
input window_index: gather_index dims=[0]
input cu_seqlens: segment_offsets dims=[0] group=0
input max_seqlen: max_seqlen group=0
inputs: 1 parameters and module state (used in place)""",
    )


def test_a_bucket_prints_bounded_sizes_with_le_and_fixed_sizes_with_eq():
    bucket = BucketShape(64, {PATCHES: 64, SEGMENTS: 5, WINDOWS: 16}, (4,), (64,), fixed=frozenset({WINDOWS}))
    assert bucket.format(_spec()) == (
        "budget 64: segments=[4] max_seqlen=[64] (cu_seqlens.shape[0]<=5 patches.shape[0]<=64 window_index.shape[0]==16)"
    )
    assert bucket.format() == "budget 64: segments=[4] max_seqlen=[64] (s0<=64 s1==16 s2<=5)"
