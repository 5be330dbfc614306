import pytest
import torch

from vgraph_compile.cli import main

EXAMPLES = "vgraph_compile.sample_models.explain_factories"


def test_explain_prints_table_derivation_and_roles(capsys):
    main(
        [
            "explain",
            "--patch-size",
            "14",
            "--window-size",
            "112",
            "--budgets",
            "1024",
            "4096",
            "--max-items",
            "8",
            "--module",
            "vgraph_compile.sample_models.explain_factories:windowed_vit",
        ]
    )
    out = capsys.readouterr().out
    assert "windows = Min(floor(B/m**2), floor(((w - 1)*Min(F, floor(B/m**2)) + floor(B/m**2))/w)) = 262" in out
    assert "input window_index: gather_index dims=[0]" in out
    assert "budget 4096: segments=[262, 8] max_seqlen=[64, 4096]" in out


@pytest.mark.parametrize(
    "factory, tokens, bucket",
    [
        ("cls_vit", "tokens: cu_seqlens.shape[0] + patches.shape[0] - 1", "patches.shape[0]<=255"),
        ("register_vit", "tokens: 4*cu_seqlens.shape[0] + patches.shape[0] - 4", "patches.shape[0]<=252"),
    ],
)
def test_explain_encoders_whose_tokens_are_sums(capsys, factory, tokens, bucket):
    """A CLS row or 4 registers per image: the rows are a sum, and patches get the budget less one image's rows."""
    main(["explain", "--patch-size", "14", "--budgets", "256", "--max-items", "4", "--module", f"{EXAMPLES}:{factory}"])
    lines = capsys.readouterr().out.splitlines()
    assert tokens in lines
    assert f"budget 256: segments=[4] max_seqlen=[256] (cu_seqlens.shape[0]<=5 max_seqlen<=256 {bucket})" in "\n".join(
        lines
    )


def test_precompile_saves_an_artifact_a_later_start_loads(tmp_path, capsys):
    """precompile compiles and saves; a second precompile of the same factory and options serves from what was
    saved (no trace, no compile)."""
    from vgraph_compile.counters import counters

    argv = ["precompile", f"{EXAMPLES}:cls_vit", "--artifact-dir", str(tmp_path)]
    argv += ["--options", '{"token_budgets": [64, 128], "max_segments": 4, "attention_backend": "sdpa"}']
    # the two blocks are identical: one shared subgraph called twice (blocks_compiled_once=2)
    with counters.expect(traces=1, sites_found=2, nodes_rewritten=4, compiles=1, blocks_compiled_once=2,
                         artifacts_saved=1, plans_saved=2, buckets_built=2, replays=1):  # fmt: skip
        main(argv)
    assert ": saved (build plan and compiled encoder" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*.bin"))) == 1 and len(list(tmp_path.glob("*.plan"))) == 2
    torch._dynamo.reset()
    with counters.expect(plans_loaded=1, artifacts_loaded=1, buckets_built=2, replays=1):
        main(argv)
    assert ": already saved (build plan and compiled encoder" in capsys.readouterr().out


@pytest.mark.parametrize(
    "family, tier",
    [
        ("qwen2_vl", "qwen2_vl (Qwen2VisionTransformerPretrainedModel): tier: whole-tower graph"),
        (
            "cosmos3_edge",
            "cosmos3_edge (Cosmos3EdgeVisionModel): tier: block graphs (1 blocks of encoder.layers, one graph); the "
            "whole forward is not one graph: it reads a grid-derived tensor on the host (tolist) at "
            "models/cosmos3_edge/modeling_cosmos3_edge.py:385",
        ),
    ],
)
def test_explain_names_the_tier_of_a_family_and_why(capsys, family, tier):
    """``--family``: the tier compile_vision_tower picks, and for block graphs the host op with its file and line."""
    main(["explain", "--family", family, "--tiny"])
    assert capsys.readouterr().out.startswith(tier)
