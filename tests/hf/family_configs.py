"""The configuration space of a transformers family's vision tower and of the options it is compiled with, as
hypothesis strategies, and the check that a tower drawn from them is served: compiled once, every call replayed from
bucket graphs, equal to the stock tower.

``tower_sizes(name)`` reads the family's released config and draws only the fields it has (no per-family code):
depth 1-4; the full-attention layout (``fullatt_block_indexes``: none, all or a subset of the blocks); every other
list of block indexes (deepstack taps: empty, one or several); width, heads and a head_dim that need not be a
multiple of 8; spatial merge, patch, temporal patch and window sizes; the side of the position table.
``serving_options()`` draws what a user passes with the tower: one to three token budgets (the largest at least
128 rows), ``max_items`` (1-4), ``max_frames`` (its default, ``max_items``, or more), the compiler (``eager`` or
``inductor``) and the attention kernel among those that run on the CPU (``sdpa``, ``flex``).
``check_served(name, fields, options)`` builds the tower at those fields and serves, each compared with the stock
tower in fp32: one image; several images and a video, in one graph call when the options let them share one (else
split); more items than ``max_items``, split over graph calls; and an image of one merge unit. An inductor draw is
served twice on an inductor and vgraph cache of its own: fresh, then warm (a new tower and trace loading what the
first one wrote). A config the stock tower itself cannot build or run is rejected (``hypothesis.reject``), not
failed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from hypothesis import reject
from hypothesis import strategies as st

from tests.helpers import counter_changes
from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower, routed_attention
from vgraph_compile.sample_models.vision_utils_towers import TINY_SIZES, build_tower, released_config, shrunk

__all__ = ["ServingOptions", "tower_sizes", "tiny_sizes", "serving_options", "check_served", "inductor_cache"]

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


@dataclass(frozen=True)
class ServingOptions:
    """The options a tower is compiled with (``compile_vision_tower``'s keywords), as drawn."""

    token_budgets: tuple[int, ...]
    max_items: int
    max_frames: int | None
    """None: the default (``frames``)."""
    compiler: str
    attention_backend: str

    def keywords(self) -> dict:
        """``compile_vision_tower``'s keywords (``max_frames`` left out at its default)."""
        keywords = dict(token_budgets=list(self.token_budgets), max_items=self.max_items, compiler=self.compiler,
                        attention_backend=self.attention_backend)  # fmt: skip
        return keywords if self.max_frames is None else {**keywords, "max_frames": self.max_frames}

    @property
    def frames(self) -> int:
        """The most frames of one graph call: ``max_frames``, by default ``max(max_items, 16)``
        (``compile_packed_tower``'s)."""
        return max(self.max_items, 16) if self.max_frames is None else self.max_frames

    def one_call(self, grid: list[tuple[int, int, int]]) -> bool:
        """Whether the items of ``grid`` fit one graph call: the largest budget, ``max_items`` and ``frames``."""
        return (
            sum(t * h * w for t, h, w in grid) <= max(self.token_budgets)
            and len(grid) <= self.max_items
            and sum(t for t, _, _ in grid) <= self.frames
        )


REPORTED = ServingOptions((256, 1024), max_items=4, max_frames=None, compiler="inductor", attention_backend="sdpa")
"""The options the window-only and full-only layouts were reported to fail with (inductor, on a fresh cache and on
the warm one)."""


@st.composite
def serving_options(draw) -> ServingOptions:
    """Options drawn as the module docstring says."""
    largest = draw(st.sampled_from([128, 256, 1024]))
    smaller = draw(st.sets(st.sampled_from([64, 128, 256, 512]).filter(lambda budget: budget < largest), max_size=2))
    max_items = draw(st.integers(1, 4))
    return ServingOptions(
        token_budgets=tuple(sorted({*smaller, largest})),
        max_items=max_items,
        max_frames=draw(st.sampled_from([None, max_items, max_items + 2, 8])),
        compiler=draw(st.sampled_from(["eager", "inductor"])),
        attention_backend=draw(st.sampled_from(["sdpa", "flex"])),
    )


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


@contextlib.contextmanager
def inductor_cache(directory: Path) -> Iterator[None]:
    """Inductor's (and Triton's) on-disk cache in ``directory``, with torch's in-memory compile caches and dynamo
    cleared on entry and exit: what the block compiles starts from ``directory`` alone, as a new process would."""
    from torch._inductor.utils import clear_caches

    saved = {key: os.environ.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(directory), TRITON_CACHE_DIR=str(directory / "triton"))
    clear_caches()
    torch._dynamo.reset()
    try:
        yield
    finally:
        clear_caches()
        torch._dynamo.reset()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cases(m: int, t: int, options: ServingOptions) -> dict[str, list[tuple[int, int, int]]]:
    """The calls served (merge ``m``; ``t`` temporal patches for the video, 1 where the tower serves images only):
    one image, several items (as many as ``max_items`` allows, up to three), more items than ``max_items``, and an
    image of one merge unit."""
    several = [(1, 4 * m, 6 * m), (t, 2 * m, 2 * m), (1, m, m)][: min(3, options.max_items)]
    split = [(1, 4 * m, 4 * m), (1, 2 * m, 2 * m), (t, m, 2 * m), (1, m, m), (1, 2 * m, m)][: options.max_items + 1]
    return {"one image": [(1, 2 * m, 4 * m)], "several images and a video": several, "split": split,
            "one merge unit": [(1, m, m)]}  # fmt: skip


def _serve(name: str, fields: dict, options: ServingOptions, references: dict, artifact_dir: str) -> None:
    """A tower of ``fields`` compiled with ``options`` serving every case of ``references`` ({case: (grid, pixel
    values, the stock tower's outputs)}): each call replayed from bucket graphs (no eager fallback), split over
    graph calls exactly when the options do not let its items share one, and equal to the stock outputs."""
    tower = build_tower(name, **fields)
    served = compile_vision_tower(tower, **options.keywords(), artifact_dir=artifact_dir)
    for case, (grid, pixel_values, ref) in references.items():
        before = counters.snapshot()["replays"], counters.eager_fallbacks, served.split_calls
        with torch.no_grad():
            out = served(pixel_values, torch.tensor(grid))
        assert counters.snapshot()["replays"] > before[0], f"{case}: no graph replayed"
        assert counters.eager_fallbacks == before[1], f"{case}: fell back to eager"
        assert served.split_calls - before[2] == (not options.one_call(grid)), f"{case}: {grid} split or not"
        _assert_same(out, ref, case)


def check_served(name: str, fields: dict, options: ServingOptions) -> None:
    """The tower of ``fields`` compiled with ``options`` (inductor: on a fresh cache, then on that warm cache, which
    serves with no trace and no compile) serves every case (``_serve``); ``reject()`` for a config the stock tower
    cannot build or run on one image."""
    try:
        tower = build_tower(name, **fields)
    except Exception:  # the family's own config validation or module construction refuses these sizes
        reject()
    probe = compile_vision_tower(tower, compiler="eager", artifact_dir="")  # the interface only: nothing traced
    m = probe.geometry.spatial_merge_size
    t = 1 if probe.interface.video_failure is not None or options.frames < 2 else 2  # more frames: run eagerly
    references = {}
    for case, grid in _cases(m, t, options).items():
        grid_thw = torch.tensor(grid)
        pixel_values = torch.randn(probe.interface.pixel_values_shape(int(grid_thw.prod(-1).sum())))
        try:
            references[case] = grid, pixel_values, _stock(tower, pixel_values, grid_thw)
        except Exception:  # the stock tower itself fails at these sizes (a rotary width it cannot split)
            if case == "one image":
                reject()
            raise
    if options.compiler == "eager":
        return _serve(name, fields, options, references, artifact_dir="")
    with tempfile.TemporaryDirectory(prefix="vgraph-sweep-") as directory:
        for phase in ("fresh cache", "warm cache"):
            with inductor_cache(Path(directory) / "inductor"), counter_changes() as changes:
                try:
                    _serve(name, fields, options, references, artifact_dir=str(Path(directory) / "vgraph"))
                except Exception as failure:
                    failure.add_note(f"served on the {phase}")
                    raise
        assert (changes["traces"], changes["compiles"]) == (0, 0), f"warm cache: traced or compiled again: {changes}"
