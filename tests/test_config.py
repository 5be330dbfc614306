import pytest
from hypothesis import given, strategies as st

from vgraph_compile.config import VGraphConfig, generate_budgets
from vgraph_compile.geometry import VisionGeometry


def test_generate_budgets_grows_by_one_ratio_up_to_the_max():
    assert generate_budgets(64, 1024) == (64, 128, 256, 512, 1024)
    assert generate_budgets(64, 800) == (64, 121, 227, 426, 800)
    assert generate_budgets(1024, 1024) == (1024,)
    assert generate_budgets(64, 1000, growth=100.0) == (64, 1000)


@given(
    st.integers(1, 4096), st.integers(1, 65536), st.floats(1.01, 3.0), st.sampled_from([1, 4, 9]),
    st.integers(0, 8192),
)
def test_generated_budgets_never_step_past_the_growth_in_cost(low, high, growth, multiple, fixed_rows):
    """Every budget a multiple of ``multiple`` (the ends as given), increasing, from min to max, and each step's
    cost (rows + fixed_rows) at most ``growth`` (plus the rounding to ``multiple``)."""
    low, high = min(low, high), max(low, high)
    budgets = generate_budgets(low, high, growth, multiple, fixed_rows)
    assert budgets[0] == low and budgets[-1] == high and list(budgets) == sorted(set(budgets))
    assert all(budget % multiple == 0 for budget in budgets[1:-1])
    for smaller, larger in zip(budgets, budgets[1:]):
        assert larger + fixed_rows <= growth * (smaller + fixed_rows) + multiple


def test_defaults():
    """Buckets spaced by cost: 64 merged tokens up to 16384, each step's rows + 1024 at most 1.1x the last, so
    coarse at the bottom and about 10% apart at the top."""
    config = VGraphConfig()
    assert config.budgets[0] == 64 and config.budgets[-1] == 16384
    assert max((b + 1024) / (a + 1024) for a, b in zip(config.budgets, config.budgets[1:])) <= 1.1 + 1e-9
    assert config.segments == 64
    merged = VGraphConfig(geometry=VisionGeometry(patch_size=14), max_items=8)
    assert merged.budgets[0] == 64 * 4 and merged.budgets[-1] == 16384
    assert all(budget % 4 == 0 for budget in merged.budgets)
    steps = [b / a for a, b in zip(merged.budgets, merged.budgets[1:])]
    assert steps[0] > 1.4 and steps[-1] < 1.11
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
        (dict(captures="lazy"), r"captures='lazy' is unknown: use one of \['behind', 'first_call'\]"),
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

    config = VGraphConfig(
        min_tokens=1024, max_tokens=16384, budget_growth=1.5, budget_fixed_rows=0, geometry=VisionGeometry(14)
    )
    assert config.budgets == (1024, 1524, 2264, 3364, 4996, 7420, 11028, 16384)
    assert all(b % 4 == 0 for b in config.budgets)
    with pytest.raises(ValueError, match="budget_growth must be > 1"):
        VGraphConfig(budget_growth=1.0)
    with pytest.raises(ValueError, match="budget_fixed_rows must be >= 0, got -1: 0 spaces budgets by rows alone"):
        VGraphConfig(budget_fixed_rows=-1)
