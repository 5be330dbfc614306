"""Attention backends behind ``vgraph::varlen_attention``.

Every backend computes the same function on packed ``[tokens, heads, head_dim]`` tensors: rows of segment ``i``
(``cu_seqlens[i] <= row < cu_seqlens[i + 1]``) attend to the rows of the same segment only. Rows at or past
``cu_seqlens[-1]`` belong to no segment; they come out zero (``segments.finish_output``), so what a kernel leaves
there never leaks. No real row of one segment may depend on any value of another, NaN and Inf included: kernels
that multiply across segments under a mask (``sdpa``, ``flex``, and ``fa4``, whose key tiles cross segment edges)
run ``segments.confined``, whose epilogue also zeroes the padding rows; for the other varlen kernels
(``torch_varlen``, ``cudnn``, ``flashinfer``), which read each segment's own rows only, the op zeroes them.
Backends must not synchronise with the host: they run inside captured CUDA graphs.

Optional kernels are imported lazily, so a missing package is reported when that backend is chosen, not at import.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Mapping

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of packed varlen attention."""

    name: str
    """The kernel's name; its module under ``vgraph_compile.kernels`` too, unless ``module`` names another."""
    supports: Callable[["torch.device", "torch.dtype"], bool]
    """Whether the kernel can run on this device and dtype (checked before a graph is built)."""
    qkv_offsets: bool = False
    """Reads packed element offsets ``[Q/K/O | V]`` (``vgraph::qkv_offsets_varlen_attention``) instead of token
    cu_seqlens; the ``lower_qkv_offsets`` pass rewrites sites for it."""
    package: tuple[str, str] | None = None
    """(import name, pip package) of the optional package the kernel needs, checked when it is chosen."""
    timed_by_auto: bool = True
    """Whether ``attention_backend="auto"`` times this kernel on a GPU (``rewrite/kernel_choice.py``). Not: the
    CPU reference, and FlexAttention, whose compile per shape adds seconds to warm-up and which was the slowest
    kernel on every ViT shape measured on an H200 (BENCHMARKS.md); either runs when named."""
    confined: bool = False
    """The module's ``attention`` is ``segments.confined(unconfined)``: its output already has the padding rows
    zeroed, so the op does not zero them again."""
    head_dims: tuple[int, ...] | None = None
    """Head dims the kernel runs, ascending (None: any). The op zero-pads q/k/v to the next one and slices the
    output back; zero columns change no score, and the softmax scale stays the original head_dim's."""

    whole_rows: bool = False
    """The kernel's work grows with all of its rows squared, whatever the segments (``kernels/dense.py``):
    ``attention_backend="auto"`` gives it only calls whose offsets hold one segment, so no call of several
    images pays for the others' rows, and the separation columns stay two whatever ``max_segments`` is."""

    module: str | None = None
    """The module under ``vgraph_compile.kernels`` defining the kernel, where it is not ``name`` (kernels that share
    one module)."""
    function: str = "attention"
    """The kernel's function in its module: ``function(q, k, v, offsets, max_seqlen, scale)``."""

    def __post_init__(self) -> None:
        if self.qkv_offsets and self.head_dims is not None:
            raise ValueError(
                f"backend {self.name!r}: packed element offsets count head_dim, so a packed kernel cannot declare "
                "head_dims to pad to"
            )

    def padded_head_dim(self, head_dim: int) -> int:
        """The head dim the kernel runs ``head_dim`` at: itself, or the smallest supported one above it."""
        if self.head_dims is None or head_dim in self.head_dims:
            return head_dim
        wider = [supported for supported in self.head_dims if supported > head_dim]
        if not wider:
            raise ValueError(
                f"attention backend {self.name!r} runs head_dim up to {self.head_dims[-1]}, got {head_dim}: "
                "choose another attention_backend"
            )
        return wider[0]

    def unavailable(self, device: "torch.device", dtype: "torch.dtype") -> str | None:
        """Why the kernel cannot run on ``device`` with ``dtype`` (its package missing, or the device or dtype
        unsupported), in a message that says what to do; None when it can."""
        if self.package is not None and not _installed(self.package[0]):
            return (
                f"attention backend {self.name!r} needs the optional package {self.package[1]}: "
                f"pip install {self.package[1]}"
            )
        if not self.supports(device, dtype):
            return (
                f"attention backend {self.name!r} cannot run on {device.type} with {dtype}: every backend but sdpa "
                "and flex needs CUDA and fp16/bf16 (cudnn: an sm80+ GPU, fa4: sm90+); use attention_backend='auto' "
                "or 'sdpa'"
            )
        return None

    def available(self, device: "torch.device", dtype: "torch.dtype") -> bool:
        """Whether the kernel can run here: its package installed and ``device``/``dtype`` supported."""
        return self.unavailable(device, dtype) is None

    def load(self) -> Callable[..., "torch.Tensor"]:
        return getattr(importlib.import_module(f"vgraph_compile.kernels.{self.module or self.name}"), self.function)

    def prepare(self, device: "torch.device") -> None:
        """Set up what the kernel keeps across calls (e.g. a workspace) before any graph is captured."""
        prepare = getattr(importlib.import_module(f"vgraph_compile.kernels.{self.module or self.name}"), "prepare", None)
        if prepare is not None:
            prepare(device)


def installed_packages() -> dict[str, str | None]:
    """The version of every optional kernel package (pip name -> version, None where absent), read from the
    installed distributions without importing them: what ``attention_backend="auto"`` can choose from, so a saved
    plan made before the GPU install is not loaded after it (``entry/warm_start``)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for backend in BACKENDS.values():
        if backend.package is not None:
            try:
                versions[backend.package[1]] = metadata.version(backend.package[1])
            except metadata.PackageNotFoundError:
                versions[backend.package[1]] = None
    return versions


def _installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _cuda_half(device: "torch.device", dtype: "torch.dtype") -> bool:
    import torch

    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _torch_varlen_present()


def _torch_varlen_present() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _cuda_half_kernel(device: "torch.device", dtype: "torch.dtype") -> bool:
    import torch

    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def _hopper_half_kernel(device: "torch.device", dtype: "torch.dtype") -> bool:
    import torch

    return _cuda_half_kernel(device, dtype) and torch.cuda.get_device_capability(device) >= (9, 0)


def _cudnn_attention(device: "torch.device", dtype: "torch.dtype") -> bool:
    """cuDNN's fused attention: a cuDNN build of torch and an sm80+ GPU."""
    import torch

    return (
        _cuda_half_kernel(device, dtype)
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def _dense_flash(device: "torch.device", dtype: "torch.dtype") -> bool:
    """torch's SDPA flash kernel: fp16/bf16 on CUDA, or its CPU kernel (which the CPU tests run)."""
    return _cuda_half_kernel(device, dtype) or device.type == "cpu"


BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        AttentionBackend("sdpa", lambda device, dtype: True, timed_by_auto=False, confined=True),
        AttentionBackend("torch_varlen", _cuda_half),
        AttentionBackend(
            "cudnn", _cudnn_attention, package=("cudnn", "nvidia-cudnn-frontend"), head_dims=tuple(range(8, 129, 8))
        ),
        AttentionBackend(
            "fa4",
            _hopper_half_kernel,
            package=("flash_attn.cute", "flash-attn-4"),
            head_dims=tuple(range(8, 129, 8)),
            confined=True,
        ),
        AttentionBackend(
            "flashinfer", _cuda_half_kernel, qkv_offsets=True, package=("flashinfer", "flashinfer-python")
        ),
        AttentionBackend("qkv_offsets_reference", lambda device, dtype: True, qkv_offsets=True),
        AttentionBackend("flex", lambda device, dtype: dtype.is_floating_point, timed_by_auto=False, confined=True),
        AttentionBackend(
            "dense_cudnn", _cudnn_attention, module="dense", function="cudnn", confined=True, whole_rows=True
        ),
        AttentionBackend(
            "dense_flash", _dense_flash, module="dense", function="flash", confined=True, whole_rows=True
        ),
        AttentionBackend(
            "dense_efficient", _cuda_half_kernel, module="dense", function="efficient", confined=True, whole_rows=True
        ),
    )
}
"""Every kernel by its name, written once (``AttentionBackend.name``). The ``dense_*`` kernels run the whole rows
as one SDPA call (``kernels/dense.py``): the kernels a stock tower's SDPA picks, timed by ``auto`` beside the varlen
ones for calls of one segment only (``AttentionBackend.whole_rows``)."""

AttentionBackendName = Literal[("default", *BACKENDS)]  # type: ignore[valid-type]
"""Names accepted by the ops' ``backend`` argument, made from ``BACKENDS``. ``"default"`` is a fixed rule
(``resolve``); the measured choice is ``VGraphConfig.attention_backend="auto"`` (``rewrite/kernel_choice.py``)."""


def by_rows(choices: "Mapping[int, str]", one_segment: "Mapping[int, str] | None" = None) -> str:
    """One ``backend`` argument for a kernel per bucket: ``{rows: kernel}`` (the rows of each bucket's attention
    call) as ``"4096:torch_varlen;16384:cudnn"``; ``one_segment`` adds the kernels of calls whose offsets hold one
    segment (``"1x16384:dense_cudnn"``), where it differs from ``choices`` at some rows. A call takes the entry of
    the fewest rows at or above its own (the largest past them all), from the one-segment entries when its offsets
    hold one segment and there are some; a single kernel is its plain name."""
    one_segment = dict(one_segment or {})
    if all(choices.get(rows) == kernel for rows, kernel in one_segment.items()):
        one_segment = {}
    names = set(choices.values()) | set(one_segment.values())
    if len(names) == 1:
        return names.pop()
    return ";".join(
        [f"{rows}:{choices[rows]}" for rows in sorted(choices)]
        + [f"1x{rows}:{one_segment[rows]}" for rows in sorted(one_segment)]
    )


@functools.cache
def _entries(name: str) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]:
    """(entries for any call, entries for calls of one segment), each ``(rows, kernel)`` ascending."""
    tables: tuple[list, list] = ([], [])
    for entry in name.split(";"):
        rows, _, kernel = entry.partition(":")
        one = rows.startswith("1x")
        rows = rows[2:] if one else rows
        if not rows.isdigit() or not kernel:
            raise ValueError(
                f"attention backend {name!r}: a per-bucket choice is 'rows:kernel;...' with optional "
                "one-segment entries '1xrows:kernel'"
            )
        tables[one].append((int(rows), kernel))
    if not tables[0]:
        raise ValueError(f"attention backend {name!r}: a per-bucket choice needs entries for any call ('rows:kernel')")
    return tuple(sorted(tables[0])), tuple(sorted(tables[1]))


def kernel_names(name: str) -> tuple[str, ...]:
    """The plain kernel names ``name`` stands for (itself, or each of a ``by_rows`` choice)."""
    if ":" not in name:
        return (name,)
    many, one = _entries(name)
    return tuple(kernel for _, kernel in (*many, *one))


def has_one_segment_entries(name: str) -> bool:
    """Whether ``name`` gives calls of one segment kernels of their own (``by_rows``'s ``1x`` entries)."""
    return ":" in name and bool(_entries(name)[1])


def pick(name: str, rows: int | None = None, segments: int | None = None) -> str:
    """The plain kernel name ``name`` gives an attention call of ``rows`` rows whose offsets hold ``segments``
    segments (None: unknown; the largest entry of a ``by_rows`` choice, for any call)."""
    if ":" not in name:
        return name
    many, one = _entries(name)
    table = one if segments == 1 and one else many
    return next((kernel for limit, kernel in table if rows is not None and rows <= limit), table[-1][1])


def resolve(
    name: str, device: "torch.device", dtype: "torch.dtype", rows: int | None = None, segments: int | None = None
) -> AttentionBackend:
    """The backend ``name`` stands for on ``device``/``dtype``, for an attention call of ``rows`` rows whose offsets
    hold ``segments`` segments (``pick``).

    ``"default"`` is a fixed rule, no measurement: torch's varlen FlashAttention-2 for fp16/bf16 on CUDA, else the
    SDPA block-diagonal reference.
    """
    if ":" in name:
        return resolve(pick(name, rows, segments), device, dtype)
    if name == "default":
        return BACKENDS["torch_varlen"] if _cuda_half(device, dtype) else BACKENDS["sdpa"]
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}: choose one of {['default', *BACKENDS]}"
        )
    backend = BACKENDS[name]
    reason = backend.unavailable(device, dtype)
    if reason is not None:
        raise ValueError(reason)
    return backend
