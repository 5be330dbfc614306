"""``VGraphConfig``: every knob of the vgraph backend, validated when it is built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from vgraph_compile.kernels.registry import BACKENDS, AttentionBackendName

CALL_CHOICES = ("measured", "smallest_bucket", "exact_size", "stock")
"""The values of ``VGraphConfig.call_choice``."""
CAPTURES = ("behind", "first_call")
"""The values of ``VGraphConfig.captures``."""
from vgraph_compile.geometry import VisionGeometry

__all__ = ["VGraphConfig", "generate_budgets"]

DEFAULT_MIN_MERGED_TOKENS = 64
"""The smallest generated budget holds this many merged tokens (64 x merge^2 patches with a geometry)."""
DEFAULT_MAX_TOKENS = 16384
DEFAULT_BUDGET_GROWTH = 1.1
"""Default ratio between the costs of generated budgets (``generate_budgets``): a large call pays at most 10% for
padding rows. A bucket costs one CUDA graph capture (a fraction of a second), not a compile."""
DEFAULT_BUDGET_FIXED_ROWS = 1024
"""Default rows whose work equals a call's fixed cost. On an H200 a released Qwen2-VL or Qwen3-VL tower replays its
256-row bucket in 2.2-2.3 ms and adds 1.5-2.3 us per row above it (``benchmarks/results/roofline_h200_*.json``): the
fixed part is 750-1500 rows' worth, so a small bucket's padding rows cost little and a large one's cost their share."""
DEFAULT_MAX_SEGMENTS = 64


def generate_budgets(
    min_tokens: int, max_tokens: int, growth: float = 2.0, multiple: int = 1, fixed_rows: int = 0
) -> tuple[int, ...]:
    """Budgets from ``min_tokens`` to ``max_tokens`` whose costs ``rows + fixed_rows`` grow by one ratio of at most
    ``growth`` (as few steps as that allows; each budget rounded up to ``multiple``). (64, 1024) -> 64, 128, 256,
    512, 1024. With ``fixed_rows`` the small budgets are coarse in rows and the large ones fine: padding rows cost
    a call at most ``1 - 1/growth`` of its cost. A smaller growth: less padding, more graphs."""
    low, high = min_tokens + fixed_rows, max_tokens + fixed_rows
    steps = math.ceil(math.log(high / low) / math.log(growth) - 1e-9) if high > low else 0
    budgets = [min_tokens]
    for step in range(1, steps):
        rounded = math.ceil((low * (high / low) ** (step / steps) - fixed_rows) / multiple) * multiple
        if budgets[-1] < rounded < max_tokens:
            budgets.append(rounded)
    if max_tokens > min_tokens:
        budgets.append(max_tokens)
    return tuple(budgets)


@dataclass(frozen=True)
class VGraphConfig:
    """How the vgraph backend buckets, bounds and compiles an encoder.

    Pass it as ``torch.compile(m, backend="vgraph", options={...})`` (the same field names) or to
    ``vgraph_compile.encoder(...)``.
    """

    token_budgets: tuple[int, ...] | None = None
    """Token counts (rows of the attention's q) to compile one graph each for. None: generated from min/max."""
    min_tokens: int | None = None
    """Smallest generated budget (with ``token_budgets`` unset); default 64 merged tokens (64 x merge^2)."""
    max_tokens: int | None = None
    """Largest generated budget (with ``token_budgets`` unset); default 16384."""
    budget_growth: float = DEFAULT_BUDGET_GROWTH
    """Ratio between the costs (rows + ``budget_fixed_rows``) of generated budgets: padding costs a call at most
    1 - 1/growth of its cost (1.1: 9%, 2.0: 50%)."""
    budget_fixed_rows: int = DEFAULT_BUDGET_FIXED_ROWS
    """Rows whose work equals a call's fixed cost (its kernels' launch and weight reads at any size): generated
    budgets are spaced by cost, coarse where a call costs little more than that, fine where rows dominate. 0: by
    rows alone."""
    max_segments: int | None = None
    """Most attention segments (cu_seqlens entries - 1) per call and group; default min(64, smallest budget)."""
    attention_backend: Literal["auto"] | AttentionBackendName = "auto"
    """Kernel behind every varlen-attention site. auto: measured, on CUDA the fastest installed kernel per attention
    group and bucket shape, timed at the build (rewrite/kernel_choice.py); where nothing is timed (CPU) the
    ops' fixed ``"default"`` rule. flashinfer (cuDNN) and qkv_offsets_reference (its CPU
    reference) read packed [Q/K/O | V] element offsets."""
    cudagraphs: bool | None = None
    """Capture each bucket as a CUDA graph. None: on when the encoder runs on CUDA."""
    captures: Literal["behind", "first_call"] = "behind"
    """When the buckets' graphs are captured. behind: the first call is served at once and the buckets are captured
    behind it on a background thread, largest first, one at a time between calls; until its bucket is captured a
    call runs the compiled code at its exact sizes (padded, without a graph, where a size guard fails there);
    ``warmup()`` captures what is left and returns once every graph is captured. first_call: the first call (or
    ``warmup()``) captures every bucket before it is served. Over a process group whose graphs hold collectives, or
    under sequence parallelism, every rank captures at its first call."""
    call_choice: Literal["measured", "smallest_bucket", "exact_size", "stock"] = "smallest_bucket"
    """How a call that fits a bucket is run. measured: the cheapest of padding it to the smallest bucket, splitting
    it over two smaller buckets (segments whole; where the encoder's inputs allow, ``serve/split``), running the
    compiled code at the call's exact sizes with no graph, and the user's own module, by the cost table timed at
    warm-up (``serve/call_costs``: the warm-up then also runs the compiled code at every bucket's sizes) and
    the stock module's times on real calls (``serve/runtime``); smallest_bucket: the smallest bucket, but for a
    call whose padding rows cost more than the compiled code's host launch at its exact sizes (measured at warm-up
    on CUDA: a large call) or whose one segment runs another kernel at its exact sizes (``rewrite/kernel_choice``),
    which runs there (both apply under measured too);
    exact_size: always the compiled code at the call's sizes where its size guards allow, else the smallest
    bucket; stock: always the user's module where the caller can run it (``vgraph_compile.encoder`` and the HF
    towers can), else the smallest bucket. The last two are fixed choices, for comparing against measured."""
    compiler: Literal["inductor", "eager"] = "inductor"
    """What compiles the rewritten graph (once, for every bucket): inductor, or nothing, running the FX graph as is
    (fast to build; for tests and debugging)."""
    compile_blocks_once: bool = True
    """Lower each class of identical repeated blocks (the entries of a module list: a ViT's blocks) once and call
    that code per block (``compile/repeated_blocks``), instead of compiling every copy: a shorter cold compile,
    the same kernels. False: every block inline."""
    align_matmuls: bool | None = None
    """Pad misaligned matmul widths with zeros (``rewrite/align_matmuls``; exact). None: where it pays, on CUDA when a
    width is not a multiple of 16 bytes; True: every width not a multiple of 64; False: never."""
    check_values: bool = True
    """Check cu_seqlens values (start 0, non-decreasing, end at the token count) before a graph runs.
    On CUDA this reads cu_seqlens back to the host once per call."""
    geometry: VisionGeometry | None = None
    """Merge geometry of a ViT: sizes each attention group's segments and max_seqlen from proven bounds
    (frames, windows) instead of max_segments and the budget. Budgets then count patches."""
    max_items: int | None = None
    """With a geometry: most images/videos per call; default max_segments."""
    max_frames: int | None = None
    """With a geometry: most frames (temporal patches) per call, all items together; default max_items."""
    window_bound: Literal["tight", "conservative"] = "tight"
    """With a geometry: size window segments by the tight bound, or by the token budget (vLLM before #42796)."""
    window_offsets: tuple[str, ...] = ("cu_window_seqlens",)
    """With a geometry: the encoder arguments holding window-attention cu_seqlens (Qwen2.5-VL's name by default).
    Their group gets the window bound, every other group the frame bound; when the encoder has several groups
    and names none of them here, every group is sized for both (safe, looser)."""
    sequence_parallel: tuple[str, int] | None = None
    """(process group name, ranks): every rank holds a slice of the packed rows, and the full-attention sites (every
    group but the ``window_offsets`` ones) attend over the group's ranks (``rewrite/sequence_attention``). Set by
    ``CompiledVisionTower`` in sequence mode (``hf/parallel/sequence_parallel``); None: one process holds all rows."""
    static_rows: bool = False
    """The trace is static: it serves calls of exactly its one budget (``token_budgets=(rows,)``, the traced row
    count) from a static compile, with no padding. Set by ``CompiledTileTower`` for its one-tile graph, when the
    trace dynamic in the tile count cannot run one tile (``hf/whole_graph/tiles``); False: the token rows are symbolic."""
    artifact_dir: str | None = None
    """Directory of saved compiled encoders (``compile/artifacts``): the first process saves the inductor compile,
    later ones load it instead of compiling. None: the ``VGRAPH_ARTIFACT_DIR`` environment variable, else
    ``vgraph_artifacts`` under inductor's cache directory; an empty string turns saving and loading off."""
    budgets: tuple[int, ...] = field(init=False)
    """The resolved, sorted token budgets."""
    segments: int = field(init=False)
    """The resolved max_segments."""

    def __post_init__(self) -> None:
        if self.token_budgets is not None:
            if self.min_tokens is not None or self.max_tokens is not None:
                raise ValueError(
                    "VGraphConfig: give either token_budgets or min_tokens/max_tokens, not both "
                    f"(got token_budgets={self.token_budgets}, min_tokens={self.min_tokens}, "
                    f"max_tokens={self.max_tokens})"
                )
            budgets = tuple(self.token_budgets)
            if not budgets:
                raise ValueError("VGraphConfig.token_budgets is empty: give at least one token count, e.g. [4096]")
            if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in budgets):
                raise ValueError(f"VGraphConfig.token_budgets must be positive integers, got {list(budgets)}")
            if list(budgets) != sorted(set(budgets)):
                raise ValueError(
                    f"VGraphConfig.token_budgets must be strictly increasing, got {list(budgets)}: "
                    f"use {sorted(set(budgets))}"
                )
            object.__setattr__(self, "token_budgets", budgets)
        else:
            merge = self.geometry.spatial_merge_size**2 if self.geometry is not None else 1
            low = DEFAULT_MIN_MERGED_TOKENS * merge if self.min_tokens is None else self.min_tokens
            high = max(low, DEFAULT_MAX_TOKENS) if self.max_tokens is None else self.max_tokens
            if low <= 0 or high <= 0:
                raise ValueError(f"VGraphConfig: min_tokens={low} and max_tokens={high} must both be positive")
            if low > high:
                raise ValueError(f"VGraphConfig: min_tokens={low} > max_tokens={high}; swap them")
            if self.budget_growth <= 1.0:
                raise ValueError(f"VGraphConfig.budget_growth must be > 1, got {self.budget_growth}")
            if self.budget_fixed_rows < 0:
                raise ValueError(
                    f"VGraphConfig.budget_fixed_rows must be >= 0, got {self.budget_fixed_rows}: 0 spaces budgets by "
                    "rows alone"
                )
            budgets = generate_budgets(low, high, self.budget_growth, merge, self.budget_fixed_rows)
        object.__setattr__(self, "budgets", budgets)

        smallest = budgets[0]
        segments = min(DEFAULT_MAX_SEGMENTS, smallest) if self.max_segments is None else self.max_segments
        if segments <= 0:
            raise ValueError(f"VGraphConfig.max_segments must be positive, got {segments}")
        if segments > smallest:
            raise ValueError(
                f"VGraphConfig.max_segments ({segments}) must be <= the smallest token budget ({smallest}): "
                "every bucket must hold a call with that many segments. Lower max_segments or raise the "
                "smallest budget."
            )
        object.__setattr__(self, "segments", segments)

        if self.call_choice not in CALL_CHOICES:
            raise ValueError(
                f"VGraphConfig.call_choice={self.call_choice!r} is unknown: use one of {list(CALL_CHOICES)}"
            )
        if self.captures not in CAPTURES:
            raise ValueError(f"VGraphConfig.captures={self.captures!r} is unknown: use one of {list(CAPTURES)}")
        if self.attention_backend not in ("auto", "default", *BACKENDS):
            raise ValueError(
                f"VGraphConfig.attention_backend={self.attention_backend!r} is unknown: "
                f"choose one of {['auto', 'default', *BACKENDS]}"
            )
        if isinstance(self.window_offsets, str):
            raise ValueError(
                f"VGraphConfig.window_offsets={self.window_offsets!r} is a string: pass a tuple of argument names, "
                f"e.g. ({self.window_offsets!r},)"
            )
        object.__setattr__(self, "window_offsets", tuple(self.window_offsets))
        if self.window_bound not in ("tight", "conservative"):
            raise ValueError(f"VGraphConfig.window_bound={self.window_bound!r}: choose 'tight' or 'conservative'")
        if self.geometry is None and (self.max_items is not None or self.max_frames is not None):
            raise ValueError("VGraphConfig.max_items/max_frames need a geometry: pass geometry=VisionGeometry(...)")
        if self.geometry is not None:
            items = segments if self.max_items is None else self.max_items
            frames = items if self.max_frames is None else self.max_frames
            if items <= 0 or frames < items:
                raise ValueError(
                    f"VGraphConfig: max_items={items} must be positive and max_frames={frames} >= max_items"
                )
            object.__setattr__(self, "max_items", items)
            object.__setattr__(self, "max_frames", frames)
            for budget in budgets:
                self.geometry.bounds(budget, items, frames)
        if self.compiler not in ("inductor", "eager"):
            raise ValueError(f"VGraphConfig.compiler={self.compiler!r} is unknown: choose 'inductor' or 'eager'")
        if self.static_rows and (self.token_budgets is None or len(budgets) != 1):
            raise ValueError(
                f"VGraphConfig.static_rows serves one row count: give token_budgets=(rows,), got "
                f"token_budgets={self.token_budgets}"
            )

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "VGraphConfig":
        """Build from ``torch.compile(options=...)``; unknown keys raise with the list of valid ones."""
        options = dict(options or {})
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"unknown vgraph option(s) {unknown}: valid options are {names}")
        if isinstance(options.get("token_budgets"), list):
            options["token_budgets"] = tuple(options["token_budgets"])
        return cls(**options)
