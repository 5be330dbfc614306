import pytest

from vgraph_compile.config import VGraphConfig, generate_budgets
from vgraph_compile.geometry import VisionGeometry


def test_generate_budgets_doubles_then_appends_max():
    assert generate_budgets(64, 800) == (64, 128, 256, 512, 800)
    assert generate_budgets(1024, 1024) == (1024,)


def test_defaults():
    """Fine buckets: 64 merged tokens up to 16384, growing by at most 1.25 (20 or more graphs)."""
    config = VGraphConfig()
    assert config.budgets[0] == 64 and config.budgets[-1] == 16384 and len(config.budgets) >= 20
    assert max(b / a for a, b in zip(config.budgets, config.budgets[1:])) <= 1.25 + 1 / 64
    assert config.segments == 64
    merged = VGraphConfig(geometry=VisionGeometry(patch_size=14), max_items=8)
    assert merged.budgets[0] == 64 * 4 and len(merged.budgets) >= 20
    assert all(budget % 4 == 0 for budget in merged.budgets)
    assert VGraphConfig(token_budgets=[16, 32]).segments == 16


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(token_budgets=[]), "token_budgets is empty"),
        (dict(token_budgets=[0, 8]), "must be positive integers"),
        (dict(token_budgets=[8, 4]), r"strictly increasing, got \[8, 4\]: use \[4, 8\]"),
        (dict(token_budgets=[8], min_tokens=4), "either token_budgets or min_tokens/max_tokens"),
        (dict(min_tokens=512, max_tokens=256), "min_tokens=512 > max_tokens=256"),
        (dict(token_budgets=[16, 64], max_segments=32), r"max_segments \(32\) must be <= the smallest token budget"),
        (dict(max_segments=0), "max_segments must be positive"),
        (dict(attention_backend="flash"), "attention_backend='flash' is unknown"),
        (dict(compiler="aot"), "compiler='aot' is unknown"),
        (
            dict(call_choice="fastest"),
            r"call_choice='fastest' is unknown: use one of \['measured', 'smallest_bucket', 'exact_size', 'stock'\]",
        ),
        (dict(window_offsets="cu_windows"), r"window_offsets='cu_windows' is a string: .* \('cu_windows',\)"),
        (dict(token_budgets=[1, 2], static_rows=True), r"static_rows serves one row count: give token_budgets="),
    ],
)
def test_invalid_values_name_the_field_and_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        VGraphConfig(**fields)


def test_from_options():
    assert VGraphConfig.from_options({"token_budgets": [64, 128]}).budgets == (64, 128)
    with pytest.raises(ValueError, match=r"unknown vgraph option\(s\) \['budget'\]"):
        VGraphConfig.from_options({"budget": 4})


def test_budget_growth_and_merge_multiple():
    """growth 1.5 from 1024 to 16384, each a multiple of 4 (2x2 merge): at most 33% padding between budgets."""
    from vgraph_compile.geometry import VisionGeometry

    config = VGraphConfig(min_tokens=1024, max_tokens=16384, budget_growth=1.5, geometry=VisionGeometry(14))
    assert config.budgets == (1024, 1536, 2304, 3456, 5184, 7776, 11664, 16384)
    assert all(b % 4 == 0 for b in config.budgets)
    with pytest.raises(ValueError, match="budget_growth must be > 1"):
        VGraphConfig(budget_growth=1.0)
