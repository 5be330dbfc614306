"""Block graphs (``hf/blocks/block_graphs``): the families whose forward does host work are served with their glue
run as written and their block stack replayed from one bucket graph per call: equal to the eager tower (same attention
op, fp32) on packed calls of one image, several, and a video where the family takes videos; every call after the
first replays (a fall back to eager fails the test); a NaN image stays in its rows; concurrent callers get their own
rows; the tier and its reason are chosen by ``compile_vision_tower`` and shown in ``stats_table()``; on their own,
block graphs refuse a tower none of whose blocks can be one graph. Configs drawn from each family's config class
(``family_configs.tower_sizes``), with drawn options (budgets, eager or inductor on a fresh and a warm cache, sdpa
or flex), are served equal to stock: one draw in the default profile, 12 per family in
``HYPOTHESIS_PROFILE=thorough``."""

import re
import tempfile
from pathlib import Path

import pytest
import torch

from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from tests.helpers import THOROUGH, outputs_from_threads
from tests.hf.family_configs import inductor_cache, serving_options, tower_sizes
from vgraph_compile.counters import counters
from vgraph_compile.hf import CompiledBlockTower, compile_vision_tower, routed_attention
from vgraph_compile.hf.blocks.block_graphs import compile_block_tower
from vgraph_compile.hf.blocks.block_program import BlocksRefused
from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

MAX_SEQLEN_ITEM = r"item.* at transformers/utils/generic.py:\d+ \(return \(cu_seqlens.* produces a data-dependent value"
"""The whole-tower trace's refusal of muse: its attention reads max_seqlen with .item() (get_max_seqlen)."""
SERVED = {
    "cosmos3_edge": r"reads a grid-derived tensor on the host \(tolist\)",
    "hunyuan_vl": r"reads a grid-derived tensor on the host \(tolist\)",
    "hy_v4_vl": r"reads a grid-derived tensor on the host \(__int__\)",
    "minimax_m3_vl": r"its output last_hidden_state has no fixed number of rows per patch",
    "video_llama_3": r"its forward takes \['merge_sizes'\] besides the pixel rows and grid_thw",
    "minicpm_ocr": r"its forward takes neither a grid",
    "minicpmv4_6": r"its forward takes neither a grid",
    "minicpmv4_7": r"its forward takes neither a grid",
    "lfm3_vl": r"reads a grid-derived tensor on the host \(tolist\)",
    "inkling2": r"no pixel row layout derived from its config fits its patch embedding",
    "muse_glimmer": MAX_SEQLEN_ITEM,
    "muse_spark": MAX_SEQLEN_ITEM,
}
"""Families the whole-tower graph refuses, served by block graphs, with the reason the tier names (muse's at its
first call's trace: its attention reads max_seqlen with .item(), which the block program computes on the host)."""
MERGER_BETWEEN_BLOCKS = {name: dict(num_hidden_layers=3, insert_layer_id=1) for name in SERVED if "minicpm" in name}
"""Tower fields that put MiniCPM-V's merger (4x fewer rows) between blocks 1 and 2, as block 6 of 12 in the released
towers: the glue reads block 1's output, so the program is two graphs."""
FIELDS = {
    **MERGER_BETWEEN_BLOCKS,
    "lfm3_vl": dict(
        num_hidden_layers=4, layer_types=["conv", "full_attention", "full_attention", "conv"], num_key_value_heads=1
    ),
}
"""Tower fields for the served test; LFM3-VL's blocks as in its released tower: convolution blocks, which loop over
the grid and run as written, around attention blocks, served by one graph, whose keys and values have fewer heads
than the queries (grouped-query attention)."""
GRAPHS = {"lfm3_vl": 1, **{name: 2 for name in MERGER_BETWEEN_BLOCKS}}
"""Graphs (replays per call) of the served towers; one where not listed."""
IMAGES_ONLY = {"hunyuan_vl", "minicpm_ocr", "minicpmv4_6", "minicpmv4_7"}
"""Families whose stock tower takes no video (one frame per grid row)."""
def _served(name):
    """(the tower, what compile_vision_tower made of it, the block graphs that serve it) after a first call."""
    tower = build_tower(name, tiny=True, **FIELDS.get(name, {}))
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa")
    args, kwargs = tower_call(name, tower, [(1, 8, 12)])
    with torch.no_grad():
        served(*args, **kwargs)  # records the program (after the whole-tower trace was refused, for muse)
    return tower, served, served if isinstance(served, CompiledBlockTower) else served.replacement


def _replayed(served, blocks, args, kwargs):
    """The served output, and that one graph replay per segment of the program (one for the whole stack, unless the
    glue reads a block's output between blocks) and no eager fall back made it."""
    before = counters.snapshot()
    with torch.no_grad():
        out = served(*args, **kwargs)
    after = counters.snapshot()
    assert after["replays"] - before["replays"] == sum(s.host_list is None for s in blocks.program.segments)
    assert after["eager_fallbacks"] == before["eager_fallbacks"]
    return out


@pytest.mark.parametrize("name", sorted(SERVED))
def test_served_by_block_graphs_equal_to_eager(name):
    """One image, several, and a video (where the family takes videos): each call is one replay, and every row
    equals the eager tower's."""
    tower, served, blocks = _served(name)
    assert isinstance(blocks, CompiledBlockTower)
    assert re.search(SERVED[name], blocks.tier_reason)
    assert served.stats_table().startswith("tier: block graphs")
    assert sum(segment.host_list is None for segment in blocks.program.segments) == GRAPHS.get(name, 1)
    t = 1 if name in IMAGES_ONLY else 2
    for grid in ([(1, 8, 12)], [(1, 8, 8), (1, 2, 2), (1, 4, 6)], [(t, 4, 4), (1, 2, 4)]):
        args, kwargs = tower_call(name, tower, grid)
        out = _replayed(served, blocks, args, kwargs)
        with torch.no_grad(), routed_attention(tower):
            ref = tower(*args, **kwargs)
        assert not out.last_hidden_state.isnan().any()
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)


def _drawn_served(name, fields, options):
    """The tower of ``fields`` (over the family's ``FIELDS``) compiled with the drawn ``options``' budgets, compiler
    and attention kernel, served by whatever tier ``compile_vision_tower`` picks, equal to the stock tower on one
    image, several and a video; inductor on a fresh cache, then on that warm cache. ``reject()`` where the stock
    tower cannot build or run one image at those sizes."""
    fields = {**fields, **FIELDS.get(name, {})}
    try:
        tower = build_tower(name, **fields)
        args, kwargs = tower_call(name, tower, [(1, 8, 12)])
        with torch.no_grad(), routed_attention(tower):
            tower(*args, **kwargs)
    except Exception:  # the family's config validation, or its stock tower at these sizes
        reject()
    t = 1 if name in IMAGES_ONLY else 2
    references = []
    for grid in ([(1, 8, 12)], [(1, 8, 8), (1, 2, 2), (1, 4, 6)], [(t, 4, 4), (1, 2, 4)]):
        args, kwargs = tower_call(name, tower, grid)
        with torch.no_grad(), routed_attention(tower):
            references.append((grid, args, kwargs, tower(*args, **kwargs).last_hidden_state))
    keywords = dict(token_budgets=list(options.token_budgets), compiler=options.compiler,
                    attention_backend=options.attention_backend)  # fmt: skip

    def serve(artifact_dir: str, phase: str) -> None:
        served = compile_vision_tower(tower, **keywords, artifact_dir=artifact_dir)
        for grid, args, kwargs, ref in references:
            with torch.no_grad():
                out = served(*args, **kwargs).last_hidden_state
            assert not out.isnan().any(), (name, fields, options, grid, phase)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m, at=(grid, phase): f"{at}: {m}")

    if options.compiler == "eager":
        return serve("", "eager")
    with tempfile.TemporaryDirectory(prefix="vgraph-blocks-") as directory:
        for phase in ("fresh cache", "warm cache"):
            with inductor_cache(Path(directory) / "inductor"):
                serve(str(Path(directory) / "vgraph"), phase)


_DRAWN = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=1, **_DRAWN)
@given(name=st.sampled_from(sorted(SERVED)), data=st.data())
def test_a_drawn_config_of_a_block_tier_family_is_served_equal_to_stock(name, data):
    """One family, one config drawn from its config class (``family_configs.tower_sizes``: depth, widths, heads,
    merge, patch and position-table sizes) and drawn options (``family_configs.serving_options``: budgets, compiler,
    kernel), served by the tier ``compile_vision_tower`` picks."""
    _drawn_served(name, data.draw(tower_sizes(name), label="config"), data.draw(serving_options(), label="options"))


@pytest.mark.skipif(not THOROUGH, reason="many configs per family: HYPOTHESIS_PROFILE=thorough")
@pytest.mark.parametrize("name", sorted(SERVED))
@settings(max_examples=12, **_DRAWN)
@given(data=st.data())
def test_drawn_configs_of_each_block_tier_family_are_served_equal_to_stock(name, data):
    _drawn_served(name, data.draw(tower_sizes(name), label="config"), data.draw(serving_options(), label="options"))


def test_nan_image_stays_in_its_rows():
    """A NaN pixel in image 0: image 1's rows are finite and equal those of the call without the NaN."""
    tower, served, blocks = _served("cosmos3_edge")
    grid = [(1, 4, 4), (1, 4, 6)]
    (pixel_values, grid_thw), kwargs = tower_call("cosmos3_edge", tower, grid)
    clean = _replayed(served, blocks, (pixel_values, grid_thw), kwargs).last_hidden_state
    pixel_values = pixel_values.clone()
    pixel_values[3, 5] = float("nan")
    poisoned = _replayed(served, blocks, (pixel_values, grid_thw), kwargs).last_hidden_state
    rows = poisoned.shape[0] * 16 // 40  # image 0: 16 of the 40 patches
    assert poisoned[:rows].isnan().any()
    torch.testing.assert_close(poisoned[rows:], clean[rows:], rtol=0, atol=0)


def test_concurrent_callers_get_their_own_rows():
    """Two threads calling with different batches: each gets its own batch's output."""
    tower, served, _ = _served("cosmos3_edge")
    calls = [tower_call("cosmos3_edge", tower, grid) for grid in ([(1, 4, 4)] * 3, [(1, 8, 6), (1, 2, 2)])]
    with torch.no_grad(), routed_attention(tower):
        expected = [tower(*args, **kwargs).last_hidden_state for args, kwargs in calls]

    results = outputs_from_threads(lambda index: served(*calls[index][0], **calls[index][1]).last_hidden_state, 2)
    for outs, want in zip(results, expected):
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_refused_without_a_tier_below_when_not_even_its_blocks_are_one_graph():
    """Block graphs compiled on their own (no ``blocks_refused``) for a one-block lfm3_vl, whose only block is a
    convolution that loops over the grid list: the first call names the reason given and the blocks', and nothing
    replays (``compile_vision_tower`` hands such a tower to the exact-size code: ``test_exact_size_tower``)."""
    tower = build_tower("lfm3_vl", tiny=True)
    served = compile_block_tower(tower, "the reason given", token_budgets=[256], compiler="eager",
                                 attention_backend="sdpa")  # fmt: skip
    args, kwargs = tower_call("lfm3_vl", tower, [(1, 4, 6)])
    refusal = r"the reason given\), and every block of layers reads a host list \(grid_thw\)"
    before = counters.snapshot()["replays"]
    with torch.no_grad(), pytest.raises(BlocksRefused, match=refusal):
        served(*args, **kwargs)
    assert counters.snapshot()["replays"] == before


def test_warmup_of_a_tower_whose_trace_is_refused_records_its_block_graphs():
    """``warmup()`` of a packed tower whose whole-tower trace is refused (muse_spark): the block graphs record and
    compile on the warm-up image, so the first call is one replay, equal to the eager tower."""
    tower = build_tower("muse_spark", tiny=True, **FIELDS.get("muse_spark", {}))
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa")
    with torch.no_grad():
        served.warmup()
    assert isinstance(served.replacement, CompiledBlockTower) and served.runtimes
    args, kwargs = tower_call("muse_spark", tower, [(1, 8, 12)])
    out = _replayed(served, served.replacement, args, kwargs)
    with torch.no_grad(), routed_attention(tower):
        ref = tower(*args, **kwargs)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    (pixel_values, grid_thw), kwargs = args, kwargs
    bad = {  # checked as the whole-tower tier checks them, before the block graphs run
        "pixel_values has 50 rows but grid_thw describes": (pixel_values[:50], grid_thw),
        "pixel_values must be a torch.Tensor, got ndarray": (pixel_values.numpy(), grid_thw),
        "pixel_values is torch.float64 on cpu but the tower is torch.float32": (pixel_values.double(), grid_thw),
    }
    for message, call in bad.items():
        with torch.no_grad(), counters.expect(), pytest.raises(ValueError, match=message):
            served(*call, **kwargs)


def test_a_bad_first_call_raises_the_stock_towers_error_not_a_refusal():
    """A first call whose pixel rows do not match its grid fails in the stock tower as written too: that error is
    raised (the caller's input), not a refusal naming the tower; a good call then records and serves."""
    tower = build_tower("cosmos3_edge", tiny=True)
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa")
    (pixel_values, grid_thw), kwargs = tower_call("cosmos3_edge", tower, [(1, 8, 12)])
    with torch.no_grad(), pytest.raises(Exception) as stock:
        tower(pixel_values[:50], grid_thw, **kwargs)
    with torch.no_grad(), pytest.raises(type(stock.value), match=re.escape(str(stock.value))) as raised:
        served(pixel_values[:50], grid_thw, **kwargs)
    assert not isinstance(raised.value, BlocksRefused)
    with torch.no_grad():
        out = served(pixel_values, grid_thw, **kwargs)
    assert served.program is not None and not out.last_hidden_state.isnan().any()


def test_served_over_a_process_group_each_rank_encoding_the_whole_call():
    """A tower the whole-tower graph cannot serve, compiled with a ``process_group``: block graphs serve it (each
    rank encodes every call whole, so the group is never used: a stand-in object suffices), one replay, equal to
    the eager tower."""
    tower = build_tower("cosmos3_edge", tiny=True)
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa",
                                  process_group=object())  # fmt: skip
    args, kwargs = tower_call("cosmos3_edge", tower, [(1, 8, 12)])
    with torch.no_grad():
        served(*args, **kwargs)  # records the program
    blocks = served if isinstance(served, CompiledBlockTower) else served.replacement
    out = _replayed(served, blocks, args, kwargs)
    with torch.no_grad(), routed_attention(tower):
        ref = tower(*args, **kwargs)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
