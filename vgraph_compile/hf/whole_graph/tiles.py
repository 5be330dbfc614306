"""Fixed-tile vision towers (SigLIP, CLIP, InternViT, Idefics3/SmolVLM's SigLIP with a patch mask, ...) served by
vgraph graphs bucketed over the tile count N of ``pixel_values[N, C, H, W]``.

Design, and why:
- **A batch-dim mode beside the packed path, not equal-length varlen segments.** These towers attend with a batch
  dim (``sdpa`` over ``[N, heads, L, d]``); packing them would mean rewriting every family's attention and masks
  into varlen calls. Instead the trace keeps the tower as written and ``analyze/tile_rows`` proves its rows
  independent (no op mixes tiles; refused with the op named otherwise). The rest is the packed path's own
  machinery: ``VGraphBackend`` with ``TILE_ANALYSES``, whose spec has N as its token rows, so ``bounds`` makes one
  bucket per budget of tiles, and the same build (one compile, dynamic in N), buffers, fill and runtime serve it.
- **Buckets:** every N up to ``exact_items`` (8: a VLM's common tile counts pad nothing), then growth by
  ``item_growth`` (1.25: at most 20% padding, one capture each) up to ``max_items`` (32). A call past
  ``max_items`` is split into calls of at most ``max_items`` tiles, and the outputs are concatenated in order.
- **Padding:** padded tiles are zero images (and an all-False patch mask); rows are proven independent, so they
  never reach a real tile, and they are dropped. A NaN/Inf tile leaves every other tile bit-identical.
- **Masks:** a call whose ``patch_attention_mask`` is all True is served as the call without one; in that trace
  the tower's own all-True mask is dropped from its attention (``rewrite/drop_true_masks``), so SDPA runs its
  unmasked kernel, as the stock tower does in eager.
- **The trace** never sees one tile: its size checks (is N 1?) would become guards that hold at N = 1 alone, so
  a first call of one tile is traced as two copies of it. A bucket whose size breaks a guard of the trace or of
  inductor is dropped, and its calls pad to the next bucket. SDPA's cuDNN mask check, which would guard N != 1,
  is kept out of the trace (``entry/backend``).
- **One tile, the commonest call, gets a graph of its own** when the dynamic build drops the bucket of one: the
  first call then also traces one tile statically (``VGraphConfig.static_rows``: one compile, one bucket, no
  padding) and every later one-tile call (or last chunk of a split call) runs there, not in the bucket of two
  (twice the work). Two guards do that, neither of which changes what the graph computes: SigLIP's MAP head
  (So400m; ``SiglipVisionModel`` with ``vision_use_head``) calls ``F.multi_head_attention_forward``, whose key
  projection is a linear of a transposed ``[L, N, E]`` view (``nn/functional.py``, ``_in_projection_packed``:
  ``kv_proj = linear(k, w_kv, b_kv)``); ``at::native::linear`` asks ``is_contiguous_or_false``, but with every
  size hinted c10's ``SymbolicShapeMeta::compute_contiguous`` compares each size with 1 through a guard, so the
  trace guards ``N != 1`` although ``backed_size_oblivious`` is on (``entry/trace_options``). On the CPU,
  inductor's convolution (``_subclasses/fake_impls.py``, ``conv``, choosing a memory format by backend) guards
  ``N >= 2`` for every tower. Treating such a guard as harmless would not be sound in general (a forward that
  branches on ``pixel_values.shape[0] == 1`` records the same guard, and its graph holds the other branch only),
  and marking N unbacked leaves the trace without the values the bounds and buffers are read from; a static
  trace of one tile is right by construction. Its cost: on an H200 (So400m 384 px with its MAP head, bf16, torch
  2.11, buckets 1-4), 11.4 s beside the dynamic trace's 28.4 s cold and 0.29 s beside 3.2 s from a warm cache
  (the saved plan and artifact load), for one tile in 3.38 ms instead of 4.55 ms in the bucket of two (stock
  tower: 12.0 ms); on the CPU, for the benchmarks' toy So400m (``bench/tile_towers``; two shared cores, two
  runs), 7 and 16 s beside 20 and 35 s cold, 0.04 and 0.35 s beside 2.2 and 4.4 s warm.
- **Not measured against the packed path:** equal-length varlen segments would need each family's attention and
  masks rewritten into varlen calls; the batch-dim mode keeps the tower's own attention (sdpa with a batch dim),
  so no family-specific code exists anywhere.
- **Outputs:** the traced forward returns the tower's own output fields (``last_hidden_state``,
  ``pooler_output``, the ``hidden_states`` an ``output_hidden_states`` flag or index list selects); one trace per
  distinct argument structure (patch mask or not, hidden-state selection), each with its own buckets.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vgraph_compile.analyze import TILE_ANALYSES
from vgraph_compile.config import VGraphConfig
from vgraph_compile.entry.decorator import CompiledEncoderFunction
from vgraph_compile.hf.outputs import OutputFactory
from vgraph_compile.hf.stand_in import TowerStandIn, TraceRefused

__all__ = [
    "CompiledTileTower",
    "compile_tile_tower",
    "is_tile_tower",
    "tile_buckets",
    "DEFAULT_MAX_ITEMS",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS = 32
DEFAULT_EXACT_ITEMS = 8
DEFAULT_ITEM_GROWTH = 1.25
_TRACE_RECOMPILE_LIMIT = 256
"""Every tile tower's trace starts in the same forward (``_TileCall.forward``): dynamo's per-code recompile limit
(8) would send the ninth tower of a process to eager."""

_PACKED_ARGUMENTS = (
    "grid_thw", "spatial_shapes", "pixel_attention_mask", "image_sizes", "cu_seqlens", "target_sizes", "tgt_sizes"
)
"""Arguments of towers that take variable-size images (packed or padded per image): not fixed-tile towers."""


def tile_buckets(
    max_items: int = DEFAULT_MAX_ITEMS, exact_items: int = DEFAULT_EXACT_ITEMS, growth: float = DEFAULT_ITEM_GROWTH
) -> tuple[int, ...]:
    """Tile counts with one graph each: 1..exact_items, then ``growth`` times larger (rounded up), then
    ``max_items``; a count closer than half a growth step below ``max_items`` is left out (8, 32, 1.25: 1..8, 10,
    13, 16, 20, 25, 32, not 31 and 32). Past ``exact_items``, consecutive counts are at most ``growth ** 1.5`` apart
    (rounded up): a call pads at most that much."""
    if max_items <= 0 or exact_items <= 0:
        raise ValueError(f"max_items={max_items} and exact_items={exact_items} must be positive")
    if growth <= 1.0:
        raise ValueError(f"item_growth must be > 1, got {growth}")
    counts = list(range(1, min(exact_items, max_items) + 1))
    value = float(exact_items)
    while max_items > counts[-1]:
        value *= growth
        if math.ceil(value) * math.sqrt(growth) >= max_items:
            counts.append(max_items)
        elif math.ceil(value) > counts[-1]:
            counts.append(math.ceil(value))
    return tuple(counts)


def _image_size(config) -> tuple[int, int] | None:
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return None


def is_tile_tower(tower: torch.nn.Module) -> bool:
    """Whether ``tower`` takes a batch of same-size images: ``forward(pixel_values, ...)`` with a config that fixes
    the image size, and none of the arguments of variable-size towers (``grid_thw``, ``spatial_shapes``, ...).
    Whether its rows are independent is proven when it is traced, not here."""
    config = getattr(tower, "config", None)
    if config is None or _image_size(config) is None:
        return False
    try:
        parameters = inspect.signature(tower.forward).parameters
    except (TypeError, ValueError):
        return False
    names = list(parameters)
    return bool(names) and names[0] == "pixel_values" and not any(name in parameters for name in _PACKED_ARGUMENTS)


@dataclass(frozen=True)
class _OutputFields:
    """The tower's output type and, per field, how its tensors sit in the traced forward's flat outputs."""

    output_class: type
    fields: tuple[tuple[str, Any], ...]
    """(name, layout): layout is "tensor", or a tuple of "tensor"/None per element of a tuple field."""
    make_output: OutputFactory

    @classmethod
    def of(cls, output) -> "_OutputFields":
        fields = []
        for name, value in output.items():
            if isinstance(value, torch.Tensor):
                fields.append((name, "tensor"))
            elif isinstance(value, (tuple, list)):
                fields.append((name, tuple("tensor" if isinstance(item, torch.Tensor) else None for item in value)))
        return cls(type(output), tuple(fields), OutputFactory(type(output)))

    @staticmethod
    def flatten(output) -> tuple[torch.Tensor, ...]:
        flat = []
        for value in output.values():
            if isinstance(value, torch.Tensor):
                flat.append(value)
            elif isinstance(value, (tuple, list)):
                flat.extend(item for item in value if isinstance(item, torch.Tensor))
        return tuple(flat)

    def build(self, flat: list[torch.Tensor]):
        values, position = {}, 0
        for name, layout in self.fields:
            if layout == "tensor":
                values[name] = flat[position]
                position += 1
                continue
            items = []
            for item in layout:
                items.append(flat[position] if item else None)
                position += bool(item)
            values[name] = tuple(items)
        return self.make_output(values)


class _TileCall(torch.nn.Module):
    """The traced forward: the tower on one chunk of tiles, its output fields flattened to a tuple of tensors."""

    def __init__(self, tower: torch.nn.Module, hidden_states: Any) -> None:
        super().__init__()
        self.tower = tower
        self.hidden_states = hidden_states

    def forward(self, pixel_values, patch_attention_mask=None):
        if patch_attention_mask is not None:  # one mask row per tile, by construction: one size symbol for both
            torch._check(patch_attention_mask.shape[0] == pixel_values.shape[0])
        out = self.tower(pixel_values, return_dict=True, **_extra(patch_attention_mask, self.hidden_states))
        return _OutputFields.flatten(out)


def _hidden_key(value: Any) -> Any:
    """``output_hidden_states`` as a hashable trace key: None (not asked), True, or a tuple of indices."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    return (value,) if isinstance(value, int) else tuple(value)


@dataclass
class _Traced:
    """The compiled forwards of one argument structure (patch mask or not, hidden-state selection)."""

    dynamic: CompiledEncoderFunction
    """The trace dynamic in the tile count N, with one graph per bucket."""
    fields: _OutputFields
    one_tile: CompiledEncoderFunction | None = None
    """A static trace of one tile (one compile, one graph), made beside ``dynamic`` when ``dynamic``'s build
    cannot run one tile; None: ``dynamic`` serves one tile in its own bucket."""
    one_tile_reason: str = ""
    """Why ``dynamic`` cannot run one tile: its dropped budget's reason."""
    checked: bool = False
    """Whether the first call has traced ``dynamic`` and made ``one_tile`` where it is needed."""
    first_call: threading.Lock = field(default_factory=threading.Lock)

    def runtimes(self) -> list:
        functions = (self.dynamic,) if self.one_tile is None else (self.dynamic, self.one_tile)
        return [runtime for function in functions for runtime in function.vgraph.runtimes]


class CompiledTileTower(TowerStandIn):
    """A fixed-tile tower served by vgraph: called like the tower, returns the tower's own output object.

    It shares the tower's parameter, buffer and submodule tables, so ``state_dict`` keys and parameter names are
    the tower's own. Calls with grad enabled on trainable parameters, in training mode, or with keywords other than
    ``patch_attention_mask``, ``output_hidden_states`` and ``return_dict`` run the stock tower.
    """

    def __init__(
        self,
        tower: torch.nn.Module,
        config: VGraphConfig,
        max_items: int,
        trace_refused: Callable[[str], torch.nn.Module] | None = None,
    ) -> None:
        super().__init__(tower)
        self.vgraph_config = config
        self.max_items = max_items
        self.trace_refused = trace_refused
        """What serves the tower when its first trace is refused (called with the reason): the exact-size code,
        from ``compile_vision_tower``; None: the refusal is raised."""
        self.split_calls = 0
        """Calls past ``max_items``, served by several graph calls."""
        self.stock_calls = 0
        self.__dict__["compiled"] = {}
        """Argument structure -> its ``_Traced``."""

    def _reset(self) -> None:
        self.compiled.clear()

    def _runtimes(self) -> list:
        """Per traced argument structure, the dynamic trace's, then the one-tile graph's where there is one."""
        return [runtime for traced in self.compiled.values() for runtime in traced.runtimes()]

    def _stats_table(self) -> str:
        lines = ["tier: whole-tower graph (fixed tiles)"]
        for traced in self.compiled.values():
            lines.extend(runtime.stats_table() for runtime in traced.dynamic.vgraph.runtimes)
            if traced.one_tile is not None:
                lines.append(
                    "one tile: its own static graph (the trace dynamic in N cannot run one tile: "
                    f"{traced.one_tile_reason})"
                )
                lines.extend(runtime.stats_table() for runtime in traced.one_tile.vgraph.runtimes)
        return "\n".join(lines)

    def _entry(self, key: tuple, pixel_values: torch.Tensor, mask: torch.Tensor | None) -> _Traced:
        """The compiled forward and output layout for one argument structure, made on its first call."""
        entry = self.compiled.get(key)
        if entry is None:
            _install_output_hooks(self.tower)
            call = _TileCall(self.tower, key[1])
            with torch.no_grad():
                first_mask = None if mask is None else mask[:1]
                sample = call.tower(pixel_values[:1], return_dict=True, **_extra(first_mask, key[1]))
            compiled = CompiledEncoderFunction(call, self.vgraph_config, analyses=TILE_ANALYSES)
            entry = self.compiled[key] = _Traced(compiled, _OutputFields.of(sample))
        return entry

    def _call(self, traced: _Traced, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """One chunk of at most ``max_items`` tiles. The first call traces the dynamic forward, then the one-tile
        graph where the dynamic build dropped the bucket of one tile; one tile runs there from then on."""
        if not traced.checked:
            with traced.first_call:
                if not traced.checked:
                    try:
                        return self._first_call(traced, args)
                    except ValueError as refusal:  # the input was checked: the trace is refused
                        raise TraceRefused(refusal) from refusal
        if traced.one_tile is not None and args[0].shape[0] == 1:
            return traced.one_tile(*args)
        return traced.dynamic(*args) if traced.dynamic.traced else _trace(traced.dynamic, args)

    def _first_call(self, traced: _Traced, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        outputs = traced.dynamic(*args) if traced.dynamic.traced else _trace(traced.dynamic, args)
        reason = _one_tile_dropped(traced.dynamic)
        if reason is not None:
            traced.one_tile_reason = reason
            traced.one_tile = CompiledEncoderFunction(
                _TileCall(self.tower, traced.dynamic.target.hidden_states),
                dataclasses.replace(self.vgraph_config, token_budgets=(1,), static_rows=True),
                analyses=TILE_ANALYSES,
            )
            one = _trace_static(traced.one_tile, tuple(arg[:1] for arg in args))
            outputs = one if args[0].shape[0] == 1 else outputs
        traced.checked = True
        return outputs

    def forward(
        self,
        pixel_values: torch.Tensor,
        patch_attention_mask: torch.Tensor | None = None,
        output_hidden_states: Any = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ):
        given = {"patch_attention_mask": patch_attention_mask, "output_hidden_states": output_hidden_states,
                 "return_dict": return_dict}  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        trainable = torch.is_grad_enabled() and any(p.requires_grad for p in self.tower.parameters())
        if kwargs or self.training or trainable or not isinstance(pixel_values, torch.Tensor):
            self.stock_calls += 1
            return self.tower(pixel_values, **given, **kwargs)
        self._check(pixel_values, patch_attention_mask)
        if self.replacement is None:
            try:
                return self._serve(pixel_values, patch_attention_mask, output_hidden_states, return_dict)
            except TraceRefused as refusal:
                if self.trace_refused is None:
                    raise refusal.args[0] from None
                self.hand_down(self.trace_refused, str(refusal.args[0]))
        return self.replacement(pixel_values, **given)

    def _serve(self, pixel_values, patch_attention_mask, output_hidden_states, return_dict):
        """A checked call, from the bucket graphs (traced at the first call of its argument structure)."""
        if patch_attention_mask is not None and self._masks_nothing(patch_attention_mask):
            patch_attention_mask = None
        if output_hidden_states is None:
            output_hidden_states = getattr(self.tower.config, "output_hidden_states", None)
        key = (patch_attention_mask is not None, _hidden_key(output_hidden_states))
        traced = self._entry(key, pixel_values, patch_attention_mask)
        chunks = []
        for start in range(0, pixel_values.shape[0], self.max_items):
            rows = slice(start, start + self.max_items)
            args = (pixel_values[rows],)
            if patch_attention_mask is not None:
                args += (patch_attention_mask[rows],)
            chunks.append(self._call(traced, args))
        if len(chunks) > 1:
            self.split_calls += 1
        flat = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*chunks)]
        output = traced.fields.build(flat)
        return output if return_dict is not False else output.to_tuple()

    def _masks_nothing(self, mask: torch.Tensor) -> bool:
        """Whether a patch mask is all True at the tower's full patch grid: the call is then the call without it
        (the tower builds that mask itself), served by the mask-free trace, whose attention runs unmasked
        (``rewrite/drop_true_masks``). Reads the mask on the host, as the stock tower's mask skip does."""
        height, width = _image_size(self.tower.config)
        patch = getattr(self.tower.config, "patch_size", None)
        if not isinstance(patch, int) or tuple(mask.shape[1:]) != (height // patch, width // patch):
            return False
        return bool(mask.all())

    def _check(self, pixel_values: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Bad input, said in the tower's argument names, before anything traces or runs."""
        height, width = _image_size(self.tower.config)
        channels = getattr(self.tower.config, "num_channels", pixel_values.shape[1] if pixel_values.dim() > 1 else 3)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (channels, height, width):
            raise ValueError(
                f"pixel_values must be [tiles, {channels}, {height}, {width}] (the tower's image size), got "
                f"{tuple(pixel_values.shape)}; resize or tile the images with the model's image processor"
            )
        if pixel_values.shape[0] == 0:
            raise ValueError("pixel_values has no tiles (shape[0] == 0): pass at least one image")
        if mask is not None and (mask.dim() != 3 or mask.shape[0] != pixel_values.shape[0]):
            raise ValueError(
                f"patch_attention_mask must be [tiles, patches high, patches wide] with one row per tile of "
                f"pixel_values ({pixel_values.shape[0]}), got {tuple(mask.shape)}"
            )


def _trace(compiled: CompiledEncoderFunction, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The first call of the trace dynamic in N. One tile is traced as two copies of it, its outputs cut back to one
    row: a trace of one tile answers its size checks (is N 1?) with guards that hold at N = 1 alone, and this
    trace must serve every N."""
    single = args[0].shape[0] == 1
    if single:
        args = tuple(torch.cat([arg, arg]) for arg in args)
    with torch._dynamo.config.patch(recompile_limit=_TRACE_RECOMPILE_LIMIT):
        outputs = compiled(*args)
    return tuple(output[:1] for output in outputs) if single else outputs


def _trace_static(compiled: CompiledEncoderFunction, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The first call of a static trace (``VGraphConfig.static_rows``): dim 0 of every argument marked static, so
    dynamo traces that tile count and no other (the caller passes views, so its own tensors stay unmarked)."""
    for arg in args:
        torch._dynamo.mark_static(arg, 0)
    with torch._dynamo.config.patch(recompile_limit=_TRACE_RECOMPILE_LIMIT):
        return compiled(*args)


def _one_tile_dropped(compiled: CompiledEncoderFunction) -> str | None:
    """Why the build of the trace dynamic in N dropped the bucket of one tile (a guard of the trace or of
    inductor's compile that fails at N = 1), or None when it serves one tile."""
    if 1 not in compiled.vgraph.config.budgets or not compiled.vgraph.runtimes:
        return None
    runtime = compiled.vgraph.runtimes[-1]
    if any(bucket.shape.budget == 1 for bucket in runtime.buckets):
        return None
    reasons = [dropped.reason for dropped in runtime.encoder.dropped if dropped.budget == 1]
    return "; ".join(reasons) or "no bucket of one tile"


def _extra(mask: torch.Tensor | None, hidden: Any) -> dict:
    """The tower's keywords for a patch mask and a hidden-state key (``_hidden_key``)."""
    extra = {} if mask is None else {"patch_attention_mask": mask}
    if hidden is not None:
        extra["output_hidden_states"] = hidden if hidden is True else list(hidden)
    return extra


def _install_output_hooks(tower: torch.nn.Module) -> None:
    """transformers installs its hidden-state hooks lazily under a lock dynamo cannot trace: install them now."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    try:
        maybe_install_capturing_hooks(tower)
    except (KeyError, TypeError, AttributeError):  # a tower that records no outputs
        log.debug("no output-capturing hooks for %s", type(tower).__name__)


def compile_tile_tower(
    tower: torch.nn.Module,
    max_items: int = DEFAULT_MAX_ITEMS,
    exact_items: int = DEFAULT_EXACT_ITEMS,
    item_growth: float = DEFAULT_ITEM_GROWTH,
    trace_refused: Callable[[str], torch.nn.Module] | None = None,
    **options: Any,
) -> CompiledTileTower:
    """Serve ``tower`` (a fixed-tile tower, see ``is_tile_tower``) from graphs bucketed over its tile count.

    ``options`` are ``VGraphConfig`` fields (``compiler``, ``cudagraphs``, ``align_matmuls``, ...); the buckets
    come from ``max_items``, ``exact_items`` and ``item_growth`` (``tile_buckets``). The tower is traced on its
    first call; a tower whose ops mix tiles is refused then: ``trace_refused`` is called with the reason, and the
    module it returns serves that call and every later one (``compile_vision_tower`` passes the exact-size code);
    without it, a ValueError naming the op is raised.
    """
    if isinstance(tower, CompiledTileTower):
        tower = tower.tower
    if not is_tile_tower(tower):
        raise ValueError(
            f"{type(tower).__name__} is not a fixed-tile tower: vgraph's tile path serves forward(pixel_values, ...) "
            "of one image size (config.image_size), without grid_thw/spatial_shapes/pixel_attention_mask arguments"
        )
    for name in ("token_budgets", "min_tokens", "max_tokens"):
        if name in options:
            raise ValueError(f"{name} is not a tile-tower option: give max_items/exact_items/item_growth")
    config = VGraphConfig.from_options({**options, "token_budgets": tile_buckets(max_items, exact_items, item_growth)})
    return CompiledTileTower(tower, config, max_items, trace_refused)
