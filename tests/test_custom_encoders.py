"""Small custom encoders built from parts, drawn by hypothesis, through plain ``torch.compile(dynamic=True)`` with
the vgraph backend and through ``vgraph_compile.encoder``: each one is equal to eager on two calls of other image
sizes, or refused with a ValueError before anything compiles. Refusals are counted, and must stay rare.

Parts: a window permutation by index (``x.view(T // 4, 4, d)[window_index]``, Qwen2.5-VL's layout, undone after
the merger), or a CLS row per image placed by ``cat`` then an index, by ``index_copy`` or by ``scatter``; learned
positions (a table indexed by position ids) or rotary ones (q and k rotated by them); window and full-attention
blocks in any order; a 2 x 2 merger.

Qwen2.5-VL's window permutation written by hand in each form a user may write it (merge units of 4 or 9 rows,
grouped by ``view``, ``reshape`` or ``unflatten``, permuted by an index or ``index_select``) is served through
plain ``torch.compile``: its row count ``T // (T // 4)``-shaped sizes reduce by the ShapeEnv's facts."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import THOROUGH, counter_changes
from tests.conftest import report
from vgraph_compile.entry.backend import vgraph_backend
from vgraph_compile.counters import counters
from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.sample_models.explain_factories import windowed_inputs

GEOMETRY = VisionGeometry(patch_size=14, temporal_patch_size=1, window_size=56)
"""Windows of 2 x 2 merged tokens (16 patches)."""
PATCH_DIM, WIDTH, HEADS, TABLE = 12, 16, 2, 64
DRAWN: list[str] = []
REFUSED: list[str] = []


class _Block(nn.Module):
    def __init__(self, rotary: bool) -> None:
        super().__init__()
        self.rotary = rotary
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, cu_seqlens, max_seqlen, angles):
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(tokens, 3, HEADS, -1).unbind(1)
        if self.rotary:
            angles = torch.cat([angles, angles], -1)[:, None]
            cos, sin = angles.cos(), angles.sin()
            q, k = ((t * cos + torch.cat([-t[..., 1::2], t[..., ::2]], -1) * sin) for t in (q, k))
        return x + self.proj(varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(tokens, -1))


class PartsEncoder(nn.Module):
    """``forward(patches, cu_seqlens, max_seqlen, cu_window_seqlens, max_window_seqlen, window_index,
    position_ids)``: the parts of ``recipe`` (see the module docstring)."""

    def __init__(self, recipe: dict) -> None:
        super().__init__()
        self.recipe = recipe
        self.embed = nn.Linear(PATCH_DIM, WIDTH)
        self.table = nn.Embedding(TABLE, WIDTH)
        self.cls = nn.Parameter(torch.randn(WIDTH))
        self.blocks = nn.ModuleList(_Block(recipe["positions"] == "rotary") for _ in recipe["blocks"])
        self.merger = nn.Linear(4 * WIDTH, WIDTH)

    def _with_cls(self, x, cu_seqlens):
        """One CLS row before each image's rows, placed as the recipe says: (rows, their offsets, CLS rows)."""
        images, width = cu_seqlens.shape[0] - 1, x.shape[1]
        offsets = cu_seqlens + torch.arange(images + 1, dtype=cu_seqlens.dtype, device=x.device)
        index = torch.arange(x.shape[0], dtype=cu_seqlens.dtype, device=x.device)
        patch_rows = (index + torch.searchsorted(cu_seqlens[1:-1], index, right=True) + 1).long()
        cls_rows = offsets[:-1].long()
        cls = self.cls.expand(images, width)
        how = self.recipe["cls"]
        if how == "cat":
            order = torch.argsort(torch.cat([cls_rows, patch_rows]))
            return torch.cat([cls, x])[order], offsets, cls_rows
        rows = x.new_zeros(x.shape[0] + images, width)
        if how == "index_copy":
            rows = rows.index_copy(0, patch_rows, x).index_copy(0, cls_rows, cls)
        else:
            rows = rows.scatter(0, patch_rows[:, None].expand(-1, width), x)
            rows = rows.scatter(0, cls_rows[:, None].expand(-1, width), cls)
        return rows, offsets, cls_rows

    def forward(self, patches, cu_seqlens, max_seqlen, cu_window_seqlens, max_window_seqlen, window_index,
                position_ids):
        recipe = self.recipe
        x = self.embed(patches)
        tokens, width = x.shape
        angles = None
        if recipe["positions"] == "rotary":
            frequencies = torch.linspace(0.1, 1.0, WIDTH // HEADS // 2, device=x.device)
            angles = position_ids.to(x.dtype)[:, None] * frequencies
        if recipe["positions"] == "learned":
            x = x + self.table(position_ids)
        if recipe["windowed"]:
            x = x.view(tokens // 4, 4, width)[window_index].reshape(tokens, width)
            if angles is not None:
                angles = angles.view(tokens // 4, 4, -1)[window_index].reshape(tokens, -1)
        cls_rows = None
        if recipe["cls"] != "none":
            x, cu_seqlens, cls_rows = self._with_cls(x, cu_seqlens)
            if angles is not None:
                angles = F.pad(angles, (0, 0, 0, cls_rows.shape[0]))  # CLS rows: unrotated past the patches
            max_seqlen = max_seqlen + 1
        for block, kind in zip(self.blocks, recipe["blocks"]):
            if kind == "window" and recipe["windowed"]:
                x = block(x, cu_window_seqlens, max_window_seqlen, angles)
            else:
                x = block(x, cu_seqlens, max_seqlen, angles)
        if cls_rows is not None:
            return x[cls_rows], x
        merged = self.merger(x.reshape(-1, 4 * width))
        return merged[torch.argsort(window_index)] if recipe["windowed"] else merged


@st.composite
def recipes(draw) -> dict:
    windowed = draw(st.booleans())
    cls = "none" if windowed else draw(st.sampled_from(["none", "cat", "index_copy", "scatter"]))
    kinds = ["window", "full"] if windowed else ["full"]
    return dict(
        windowed=windowed,
        cls=cls,
        positions=draw(st.sampled_from(["none", "learned", "rotary"])),
        blocks=draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3)),
    )


def _inputs(grid, seed):
    torch.manual_seed(seed)
    patches, cu, longest, cu_window, longest_window, window_index = windowed_inputs(GEOMETRY, grid, PATCH_DIM)
    positions = torch.cat([torch.arange(t * h * w) % TABLE for t, h, w in grid])
    return patches, cu, longest, cu_window, longest_window, window_index, positions


def _same(out, ref):
    for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (out, ref))):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@settings(max_examples=60 if THOROUGH else 2, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), entry=st.sampled_from(["torch.compile", "decorator"]))
def test_drawn_encoder_equal_to_eager_or_refused_before_compiling(recipe, entry):
    torch.manual_seed(0)
    model = PartsEncoder(recipe).eval()
    options = dict(token_budgets=[128, 512], compiler="eager", geometry=GEOMETRY, window_offsets=("cu_window_seqlens",))
    torch._dynamo.reset()
    if entry == "decorator":
        compiled = vgraph_compile.encoder(model, **options)
    else:
        compiled = torch.compile(model, backend=vgraph_backend, dynamic=True, options=options)
    DRAWN.append(f"{entry} {recipe}")
    replays = counters.replays
    for seed, grid in enumerate(([(1, 4, 8), (1, 8, 4)], [(1, 8, 12), (1, 4, 4), (1, 12, 4)])):
        inputs = _inputs(grid, seed)
        with torch.no_grad():
            ref = model(*inputs)
            compiles = counters.compiles
            try:
                out = compiled(*inputs)
            except ValueError as refusal:
                assert counters.compiles == compiles, f"refused after compiling: {refusal}"
                assert "test_custom_encoders.py:" in str(refusal), f"the refusal names no line: {refusal}"
                REFUSED.append(f"{entry} {recipe}: {refusal}")
                return
        _same(out, ref)
    assert counters.replays > replays  # bucket graphs served the calls


def test_refusals_are_rare():
    """Of the encoders drawn above, at most one in five is refused."""
    if not DRAWN:
        pytest.skip("run with the drawn-encoder test")
    report(f"custom encoders: {len(REFUSED)} of {len(DRAWN)} drawn refused before compiling")
    for refusal in REFUSED:
        report(f"  {refusal.splitlines()[0][:300]}")
    assert len(REFUSED) * 5 <= len(DRAWN), REFUSED


class HandWindowedEncoder(nn.Module):
    """Qwen2.5-VL's layout written by hand: rows grouped by the merge unit (``unit`` rows: 4 or 9) with ``group``
    (``view``, ``reshape`` or ``unflatten``), permuted into windows by ``select`` (an index or ``index_select``), a
    window block then a full-attention block, and the inverse permutation at the end."""

    def __init__(self, unit: int, group: str, select: str) -> None:
        super().__init__()
        self.unit, self.group, self.select = unit, group, select
        self.embed = nn.Linear(PATCH_DIM, WIDTH)
        self.window, self.full = _Block(rotary=False), _Block(rotary=False)

    def forward(self, patches, cu_seqlens, max_seqlen, cu_window_seqlens, max_window_seqlen, window_index):
        x = self.embed(patches)
        tokens, width, unit = *x.shape, self.unit
        if self.group == "view":
            units = x.view(tokens // unit, unit, width)
        elif self.group == "reshape":
            units = x.reshape(tokens // unit, unit, width)
        else:
            units = x.unflatten(0, (tokens // unit, unit))
        units = units[window_index] if self.select == "index" else units.index_select(0, window_index)
        x = units.reshape(tokens, width)
        x = self.window(x, cu_window_seqlens, max_window_seqlen, None)
        x = self.full(x, cu_seqlens, max_seqlen, None)
        return x.view(tokens // unit, unit, width)[torch.argsort(window_index)].reshape(tokens, width)


_HAND_WINDOWED = [
    (unit, group, select)
    for unit in (4, 9)
    for group in ("view", "reshape", "unflatten")
    for select in ("index", "index_select")
]
"""Every form: ``HYPOTHESIS_PROFILE=thorough`` runs all twelve."""
_HAND_WINDOWED_CI = [(4, "view", "index"), (9, "unflatten", "index_select")]
"""The reported form (merge units of 4, ``view``, an index), and one writing each of its options otherwise."""


@pytest.mark.parametrize("unit, group, select", _HAND_WINDOWED if THOROUGH else _HAND_WINDOWED_CI)
def test_hand_written_window_permutation_through_plain_torch_compile(unit, group, select, caplog):
    """Equal to eager on every call, and every call after the first served by a bucket graph (counted replays, no
    eager fallback). The first call has as many merge units as the patch width (12): dynamo's duck sizing makes
    ``window_index``'s length that static width, and the guards then fix the tokens at ``12 * unit``. With the
    ShapeEnv's facts (``symbolic.canonical``: ``T // (T // unit) == unit``) that trace's row count is the constant it
    is, so it runs as traced (a static trace, no refusal) and the next call traces every size once."""
    merge = {4: 2, 9: 3}[unit]
    geometry = VisionGeometry(patch_size=14, temporal_patch_size=1, spatial_merge_size=merge, window_size=56 * merge)
    torch.manual_seed(0)
    model = HandWindowedEncoder(unit, group, select).eval()
    options = dict(token_budgets=[32 * unit, 128 * unit], compiler="eager", geometry=geometry, max_items=3,
                   window_offsets=("cu_window_seqlens",))  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vgraph", dynamic=True, options=options)
    m = merge
    calls = ([(1, 2 * m, 6 * m)], [(1, 2 * m, 4 * m), (1, 4 * m, 2 * m)], [(1, 4 * m, 6 * m), (1, 2 * m, 2 * m)],
             [(1, 6 * m, 2 * m), (1, 2 * m, 4 * m), (1, 2 * m, 2 * m)])  # fmt: skip
    with torch.no_grad(), counter_changes() as changes:
        for seed, grid in enumerate(calls):
            torch.manual_seed(seed)
            inputs = windowed_inputs(geometry, grid, PATCH_DIM)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert (changes["static_traces"], changes["traces"]) == (1, 1), changes
    assert f"packed row count at {12 * unit} (with window_index.shape[0] == 12)" in caplog.text
    assert (changes["replays"], changes["eager_fallbacks"]) == (len(calls) - 1, 0), changes
