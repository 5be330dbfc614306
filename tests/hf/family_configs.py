"""The configuration space of a transformers family's vision tower, as a hypothesis strategy, and the check that a
tower drawn from it is served: compiled once, every call replayed from bucket graphs, equal to the stock tower.

``tower_sizes(name)`` reads the family's released config and draws only the fields it has (no per-family code):
depth 1-4; the full-attention layout (``fullatt_block_indexes``: none, all or a subset of the blocks); every other
list of block indexes (deepstack taps: empty, one or several); width, heads and a head_dim that need not be a
multiple of 8; spatial merge, patch, temporal patch and window sizes; the side of the position table.
``check_served(name, fields)`` builds the tower at those fields and serves one image, several images and a video
in one graph call, and five items split over graph calls, each compared with the stock tower in fp32. A config
the stock tower itself cannot build or run is rejected (``hypothesis.reject``), not failed.
"""

from __future__ import annotations

import torch
from hypothesis import reject
from hypothesis import strategies as st

from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention
from vgraph_compile.sample_models.vision_utils_towers import TINY_SIZES, build_tower, released_config, shrunk

__all__ = ["tower_sizes", "tiny_sizes", "check_served"]

_LAYER_FIELDS = ("depth", "num_hidden_layers", "num_layers")
_WIDTH_FIELDS = ("hidden_size", "embed_dim", "width")
_HEAD_FIELDS = ("num_heads", "num_attention_heads", "num_key_value_heads")
_MERGE_FIELDS = ("spatial_merge_size", "merge_size", "merge_kernel_size")
_TEMPORAL_FIELDS = ("temporal_patch_size", "patch_temporal")
_LAYOUT_FIELD = "fullatt_block_indexes"


def _tapped_fields(defaults: dict) -> list[str]:
    """The config's other lists of block indexes (``deepstack_visual_indexes``): the blocks whose outputs it taps."""
    return [
        key
        for key, value in defaults.items()
        if key != _LAYOUT_FIELD and key.endswith(("_indexes", "_indices")) and isinstance(value, list)
        and all(type(item) is int for item in value)
    ]


def _blocks(depth: int) -> st.SearchStrategy[list[int]]:
    """None of the blocks, all of them, one, or any subset, as a sorted list of indexes."""
    return st.one_of(
        st.just([]),
        st.just(list(range(depth))),
        st.integers(0, depth - 1).map(lambda index: [index]),
        st.sets(st.integers(0, depth - 1), min_size=1).map(sorted),
    )


def tower_sizes(name: str) -> st.SearchStrategy[dict]:
    """Config fields of a tower of family ``name``, drawn where its config has them (see the module docstring)."""
    defaults = released_config(name)

    @st.composite
    def sizes(draw) -> dict:
        depth = draw(st.integers(1, 4))
        heads = draw(st.integers(1, 3))
        head_dim = draw(st.sampled_from([4, 12, 16, 20]))
        width = heads * head_dim
        drawn = {key: depth for key in _LAYER_FIELDS}
        drawn.update({key: width for key in _WIDTH_FIELDS})
        drawn.update({key: heads for key in _HEAD_FIELDS})
        drawn.update(head_dim=head_dim, intermediate_size=2 * width, out_hidden_size=draw(st.sampled_from([16, 40])))
        if _LAYOUT_FIELD in defaults:
            drawn[_LAYOUT_FIELD] = draw(_blocks(depth))
        for key in _tapped_fields(defaults):
            drawn[key] = draw(_blocks(depth))
        merge = draw(st.sampled_from([1, 2]))
        for key in _MERGE_FIELDS:
            drawn[key] = [merge, merge] if isinstance(defaults.get(key), list) else merge
        patch = drawn["patch_size"] = draw(st.sampled_from([2, 4, 14]))
        for key in _TEMPORAL_FIELDS:
            drawn[key] = draw(st.sampled_from([1, 2]))
        if isinstance(defaults.get("window_size"), int):
            drawn["window_size"] = patch * merge * draw(st.sampled_from([1, 2, 4]))
        side = draw(st.sampled_from([2, 4, 6]))
        drawn.update(num_position_embeddings=side * side, pos_emb_height=side, pos_emb_width=side)
        return shrunk(defaults, {**TINY_SIZES, **drawn}, windowed_depth=None)

    return sizes()


def tiny_sizes(name: str, **fields) -> dict:
    """The family's ``TINY_SIZES`` tower with ``fields`` over them, at the depth ``fields`` give (an explicit
    example of ``tower_sizes``)."""
    depth = fields.pop("depth", 1)
    sizes = {**TINY_SIZES, **{key: depth for key in _LAYER_FIELDS}, **fields}
    return shrunk(released_config(name), sizes, windowed_depth=None)


def _assert_same(out, ref, case: str) -> None:
    assert type(out) is type(ref), case
    for name, value in ref.items():
        mine = out[name]
        if isinstance(value, (list, tuple)):
            assert isinstance(mine, (list, tuple)) and len(mine) == len(value), (case, name)
        for a, b in zip(*(v if isinstance(v, (list, tuple)) else [v] for v in (mine, value))):
            assert not a.isnan().any(), (case, name)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"{case}: {name}")


def _stock(tower, pixel_values, grid_thw):
    with torch.no_grad(), routed_attention(tower):
        return tower(pixel_values, grid_thw)


def check_served(name: str, fields: dict) -> None:
    """The tower of ``fields`` served by bucket graphs and equal to the stock tower on one image, several images
    and a video (one graph call), and five items split over graph calls; ``reject()`` for a config the stock
    tower cannot build or run on one image."""
    try:
        tower = build_tower(name, **fields)
    except Exception:  # the family's own config validation or module construction refuses these sizes
        reject()
    served = compile_vision_tower(tower, token_budgets=[256], max_items=3, compiler="eager", attention_backend="sdpa")
    m = served.geometry.spatial_merge_size
    t = 1 if served.interface.video_failure is not None else 2
    cases = {
        "one image": [(1, 2 * m, 4 * m)],
        "several images and a video": [(1, 4 * m, 6 * m), (t, 2 * m, 2 * m), (1, m, m)],
        "split": [(1, 4 * m, 4 * m), (1, 2 * m, 2 * m), (t, m, 2 * m), (1, m, m), (1, 2 * m, m)],
    }
    for case, grid in cases.items():
        grid_thw = torch.tensor(grid)
        pixel_values = torch.randn(served.interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
        if case == "one image":
            try:
                ref = _stock(tower, pixel_values, grid_thw)
            except Exception:  # the stock tower itself fails at these sizes (a rotary width it cannot split)
                reject()
        else:
            ref = _stock(tower, pixel_values, grid_thw)
        before = counters.snapshot()["replays"], counters.eager_fallbacks, served.split_calls
        with torch.no_grad():
            out = served(pixel_values, grid_thw)
        assert counters.snapshot()["replays"] > before[0], f"{case}: no graph replayed"
        assert counters.eager_fallbacks == before[1], f"{case}: fell back to eager"
        assert served.split_calls - before[2] == (case == "split"), case
        _assert_same(out, ref, case)
