from vgraph_compile.cli import main


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
            "vgraph_compile.models.examples:windowed_vit",
        ]
    )
    out = capsys.readouterr().out
    assert "windows = Min(floor(B/m**2), floor(((w - 1)*Min(F, floor(B/m**2)) + floor(B/m**2))/w)) = 262" in out
    assert "input window_index: gather_index dims=[0]" in out
    assert "budget 4096: segments=[262, 8] max_seqlen=[64, 4096]" in out
