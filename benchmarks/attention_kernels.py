"""Every installed attention backend at ViT shapes: ms per call, achieved TFLOP/s and error against fp32.

Each kernel runs through ``vgraph::varlen_attention`` (so the op's zeroing of padding rows is included), 16 heads,
bf16, head_dim 80 and 72. After three warm-up calls (JIT and cuDNN plans) the call is captured in one CUDA graph
and the replay is timed (CUDA events, median); kernels named in ``--plain`` are timed as plain launches instead,
and each row says which. Kernels that read across segment edges (``sdpa``, ``flex``, ``fa4``) run confined, as
kept; their row also gives the kernel alone (``bare_*``: the module's ``unconfined`` plus the op's zeroing of
padding rows, which lets a NaN through) and the confinement's share of the kernel's time. Each case also times the
confinement alone (confine k/v + the epilogue that marks poisoned rows and zeroes padding rows) as Triton kernels
and as the torch reference, against a copy of k and v (its memory floor), with its share of every kernel's time
measured in the same case; and the op's zeroing of padding rows as the epilogue and as ``masked_fill_``. At head_dim 72,
``fa4`` is also run on q/k/v zero-padded to 80 and 96 (``fa4 padded to N``: the padding copies included).
Shapes: one 1344^2 image (1x9216 patches), one 1792^2 image (1x12544), 4x336^2 (4x2304), 16 small segments (16x256),
Qwen2.5-VL's window attention (window_size 112 px / patch 14 = 8x8 patches = 64 rows per full window) for
1344^2 (144x64), 4x336^2 (36x64) and 280^2 (edge windows of 32 and 16 rows), and an 8192-row bucket holding
four images and 12 empty segments (``max_seqlen`` = the bucket), and the 14,212-row bucket Qwen3-VL serves one
1792^2 image in (12,544 rows, 16 segment slots). ``sdpa_dense_cudnn`` is the reference the
stock towers get: SDPA forced to cuDNN on a dense batch of equal-length segments (equal-length shapes only).

    python benchmarks/attention_kernels.py [--kernels cudnn torch_varlen ...] [--cases 1x9216 ...]
        [--head-dims 80 72] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import traceback
from datetime import date

import torch
import torch.nn.functional as F

from vgraph_compile.kernels import registry
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import median_ms
from vgraph_compile.kernels.ops import qkv_offsets_varlen_attention, varlen_attention
from vgraph_compile.kernels.segments import (
    confine_nonfinite,
    confine_nonfinite_reference,
    cu_seqlens,
    finish_output,
    finish_output_reference,
)

HEADS = 16
HEAD_DIMS = (80, 72)
WINDOW = 112 // 14
"""Qwen2.5-VL window side in patches (window_size 112 px, patch 14)."""
DENSE = "sdpa_dense_cudnn"
CONFINEMENT = "confinement"
FA4_PADDED = (80, 96)
"""Head dims ``fa4`` is also run at, zero-padded, for head_dim 72."""


def window_lengths(height_px: int, width_px: int, images: int = 1) -> list[int]:
    """Rows of each Qwen2.5-VL attention window of ``images`` images of this size (edge windows are smaller)."""
    sides = [[min(WINDOW, n - start) for start in range(0, n, WINDOW)] for n in (height_px // 14, width_px // 14)]
    return [h * w for h in sides[0] for w in sides[1]] * images


CASES: dict[str, tuple[list[int], int, int]] = {
    "1x9216": ([9216], 9216, 1),
    "1x12544": ([12544], 12544, 1),
    "4x2304": ([2304] * 4, 9216, 4),
    "16x256": ([256] * 16, 4096, 16),
    "win 144x64 (1344^2)": (window_lengths(1344, 1344), 9216, 144),
    "win 36x64 (4x336^2)": (window_lengths(336, 336, 4), 2304, 36),
    "win 9 (280^2)": (window_lengths(280, 280), 400, 9),
    "bucket 8192: 4 real + 12 empty": ([4096, 2304, 1024, 576], 8192, 16),
    "bucket 14212: 1x12544 + 15 empty": ([12544], 14212, 16),
}
"""name -> (real segment lengths, rows in the buffer, segment slots); slots beyond the real segments are empty."""


def attention_flops(lengths: list[int], head_dim: int) -> float:
    """QK^T and PV of every real segment: 4 * heads * head_dim * sum(length^2)."""
    return 4.0 * HEADS * head_dim * sum(n * n for n in lengths)


def _inputs(lengths, rows, slots, head_dim):
    bounds = cu_seqlens([*lengths] + [0] * (slots - len(lengths)))
    q, k, v = (torch.randn(rows, HEADS, head_dim, dtype=torch.bfloat16).cuda() for _ in range(3))
    max_seqlen = max(lengths) if rows == sum(lengths) else rows
    return q, k, v, bounds.cuda(), max_seqlen


def _call(name: str):
    backend = registry.BACKENDS[name]
    if not backend.qkv_offsets:
        return lambda q, k, v, cu, m: varlen_attention(q, k, v, cu, m, backend=name)

    def packed(q, k, v, cu, m):
        offsets = cu * (q.shape[1] * q.shape[2])
        return qkv_offsets_varlen_attention(q, k, v, torch.cat([offsets, offsets]), m, backend=name)

    return packed


def _bare_call(name: str):
    """The kernel without its confinement (the module's ``unconfined``), rows past the last offset zeroed as the op
    does; None for kernels that need none."""
    module = importlib.import_module(f"vgraph_compile.kernels.{registry.BACKENDS[name].module}")
    unconfined = getattr(module, "unconfined", None)
    if unconfined is None:
        return None

    def bare(q, k, v, cu, m):
        return finish_output(unconfined(q, k, v, cu, m, None).contiguous(), cu)

    return bare


def _padded_call(name: str, width: int):
    """``name`` on q/k/v zero-padded to ``width`` (the original head_dim's scale), the output sliced back."""

    def padded(q, k, v, cu, m):
        head_dim = q.shape[-1]
        wide = [F.pad(t, (0, width - head_dim)) for t in (q, k, v)]
        return varlen_attention(*wide, cu, m, head_dim**-0.5, backend=name)[..., :head_dim]

    return padded


def _timed(fn, repeats: int, capture: bool) -> tuple[float, str]:
    """Median ms of ``fn`` as a CUDA graph replay (or a plain launch), after three warm-up calls."""
    for _ in range(3):
        fn()
    if not capture:
        return median_ms(fn, repeats=repeats), "plain_launch"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, repeats=repeats), "cuda_graph_replay"


def measure(call, inputs, reference, lengths, repeats, capture=True) -> dict:
    """Error against the fp32 ``reference``, isolation of NaN padding rows, and the median time of a graph replay
    (or launch)."""
    q, k, v, cu, max_seqlen = inputs
    end, rows = sum(lengths), q.shape[0]
    out = call(q, k, v, cu, max_seqlen)
    row = {
        "rel_err_vs_fp32": round(((out[:end].float() - reference).norm() / reference.norm()).item(), 5),
        "padding_rows_zero": bool(torch.equal(out[end:], torch.zeros_like(out[end:]))),
        "finite": bool(out.isfinite().all()),
    }
    if rows > end:
        poisoned = [t.clone().index_fill_(0, torch.arange(end, rows, device="cuda"), float("nan")) for t in (q, k, v)]
        row["nan_padding_isolated"] = bool(call(*poisoned, cu, max_seqlen)[:end].isfinite().all())
    ms, row["mode"] = _timed(lambda: call(q, k, v, cu, max_seqlen), repeats, capture)
    row["tflops"] = round(attention_flops(lengths, q.shape[-1]) / ms / 1e9, 1)
    row["ms"] = round(ms, 4)
    return row


def measure_confinement(inputs, repeats) -> dict:
    """The confinement alone on clean k/v: confine + epilogue (into a kept output buffer), Triton and torch; the
    memory floor it is held to (copies of k and v: the bytes the confine pass reads and writes); and the op's
    zeroing of padding rows for an unconfined kernel, as the epilogue without flags and as ``masked_fill_``."""
    q, k, v, cu, _ = inputs
    out = torch.empty_like(q)

    def fused():
        _, _, poisoned = confine_nonfinite(k, v, cu)
        finish_output(out, cu, poisoned)

    def reference():
        _, _, poisoned = confine_nonfinite_reference(k, v, cu)
        finish_output_reference(out, cu, poisoned)

    def masked_fill():
        rows = torch.arange(out.shape[0], device=out.device, dtype=cu.dtype)
        out.masked_fill_((rows >= cu[-1])[:, None, None], 0)

    timed = {
        "triton_ms": fused,
        "torch_ms": reference,
        "copy_k_v_floor_ms": lambda: (k.clone(), v.clone()),
        "padding_epilogue_ms": lambda: finish_output(out, cu),
        "padding_masked_fill_ms": masked_fill,
    }
    row = {name: round(_timed(fn, repeats, True)[0], 4) for name, fn in timed.items()}
    return {**row, "mode": "cuda_graph_replay"}


def confinement_shares(results: dict) -> dict:
    """The confinement's time over each kernel's (the bare kernel's, for a confining one) in this case."""
    confinement = results.get(CONFINEMENT, {})
    if "triton_ms" not in confinement:
        return {}
    return {
        f"share_of_{name}": round(confinement["triton_ms"] / row.get("bare_ms", row["ms"]), 4)
        for name, row in results.items()
        if name != CONFINEMENT and "ms" in row
    }


def measure_dense(lengths, head_dim, repeats) -> dict | None:
    """SDPA on the cuDNN backend over a dense [segments, heads, length, head_dim] batch (equal lengths only)."""
    if len(set(lengths)) != 1:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(len(lengths), HEADS, lengths[0], head_dim, dtype=torch.bfloat16).cuda() for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), repeats=repeats)
    return {
        "ms": round(ms, 4),
        "mode": "plain_launch",
        "tflops": round(attention_flops(lengths, head_dim) / ms / 1e9, 1),
    }


def available(device: torch.device) -> list[str]:
    """Backends that resolve on this device for bf16 (the CPU offset reference excluded)."""
    return [
        name
        for name, backend in registry.BACKENDS.items()
        if name != "qkv_offsets_reference" and backend.available(device, torch.bfloat16)
    ]


def _guarded(measure_one) -> dict:
    try:
        return measure_one()
    except Exception as error:  # noqa: BLE001  (a kernel that fails on a shape is reported, not fatal)
        torch.cuda.synchronize()
        return {"error": traceback.format_exception_only(error)[-1].strip()[:300]}


def measure_kernel(name, inputs, reference, lengths, repeats, capture) -> dict:
    """``name`` as kept; for a confining kernel also the bare kernel and the confinement's share of its time."""
    row = _guarded(lambda: measure(_call(name), inputs, reference, lengths, repeats, capture))
    bare = _bare_call(name)
    if bare is None or "error" in row:
        return row
    alone = _guarded(lambda: measure(bare, inputs, reference, lengths, repeats, capture))
    for field in ("ms", "tflops", "nan_padding_isolated", "error"):
        if field in alone:
            row[f"bare_{field}"] = alone[field]
    if "ms" in alone:
        row["confinement_share_of_bare"] = round(row["ms"] / alone["ms"] - 1, 4)
    return row


def run(kernels: list[str], cases: list[str], head_dims: list[int], repeats: int, plain: set[str], json_path) -> dict:
    """Every case for every kernel; ``plain`` kernels are timed as plain launches (a failed capture leaves the
    process's CUDA generator unusable, so it is not tried). The JSON is rewritten after each case."""
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "date": date.today().isoformat(),
        "timing": "CUDA-event median of CUDA graph replays of one op call (plain launches where the row says so)",
        "heads": HEADS,
        "dtype": "bfloat16",
        "cases": {},
    }
    for head_dim in head_dims:
        for case in cases:
            lengths, rows, slots = CASES[case]
            key = f"d{head_dim} {case}"
            results = report["cases"][key] = {}
            inputs = _inputs(lengths, rows, slots, head_dim)
            q, k, v, cu, max_seqlen = inputs
            reference = varlen_attention(q.float(), k.float(), v.float(), cu, max_seqlen, backend="sdpa")[: sum(lengths)]
            results[CONFINEMENT] = _guarded(lambda: measure_confinement(inputs, repeats))
            for name in kernels:
                results[name] = measure_kernel(name, inputs, reference, lengths, repeats, name not in plain)
                if name == "fa4" and head_dim == 72:
                    for width in FA4_PADDED:
                        results[f"fa4 padded to {width}"] = _guarded(
                            lambda: measure(_padded_call(name, width), inputs, reference, lengths, repeats)
                        )
            del reference
            dense = measure_dense(lengths, head_dim, repeats)
            if dense is not None:
                results[DENSE] = dense
            results.get(CONFINEMENT, {}).update(confinement_shares(results))
            print(key, {name: row.get("ms", row.get("triton_ms", row.get("error"))) for name, row in results.items()})
            write_report(report, json_path)
    return report


def table(report: dict) -> str:
    kernels = sorted({name for row in report["cases"].values() for name in row}, key=str)
    lines = [
        f"{report['device']}, torch {report['torch']}, cuDNN {report['cudnn']}; {report['timing']}; "
        f"confining kernels: confined (bare) ms; {CONFINEMENT}: Triton / torch ms"
    ]
    lines.append(f"{'case':>36} " + " ".join(f"{name[:22]:>30}" for name in kernels))
    for case, row in report["cases"].items():
        cells = []
        for name in kernels:
            result = row.get(name)
            if result is None:
                cells.append("-")
            elif "error" in result:
                cells.append("error")
            elif name == CONFINEMENT:
                cells.append(f"{result['triton_ms']:.4f} / {result['torch_ms']:.3f} ms")
            elif "bare_ms" in result:
                cells.append(f"{result['ms']:.3f} ({result['bare_ms']:.3f}) ms {result['tflops']:.0f} TF")
            else:
                cells.append(f"{result['ms']:.3f} ms {result['tflops']:.0f} TF")
        lines.append(f"{case:>36} " + " ".join(f"{cell:>30}" for cell in cells))
    errors = [
        result["rel_err_vs_fp32"]
        for row in report["cases"].values()
        for result in row.values()
        if "rel_err_vs_fp32" in result
    ]
    if errors:
        lines.append(f"rel error vs fp32: median {statistics.median(errors):.4f}, max {max(errors):.4f}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError as missing:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = sorted({name for row in report["cases"].values() for name in row if "ms" in row[name]})
    figure, axes = plt.subplots(1, len(HEAD_DIMS), figsize=(16, 5), sharey=True)
    bar = 0.8 / max(1, len(kernels))
    for axis, head_dim in zip(axes, HEAD_DIMS):
        cases = [case for case in report["cases"] if case.startswith(f"d{head_dim} ")]
        for index, name in enumerate(kernels):
            values = [report["cases"][case].get(name, {}).get("tflops", float("nan")) for case in cases]
            axis.bar([c + index * bar for c in range(len(cases))], values, bar, label=name)
        axis.set_xticks(
            [c + 0.4 - bar / 2 for c in range(len(cases))],
            [c.split(" ", 1)[1] for c in cases],
            rotation=20,
            fontsize=7,
        )
        axis.set_title(f"head_dim {head_dim}, {HEADS} heads, bf16\n{report['device']}", fontsize=9)
    axes[0].set_ylabel("achieved TFLOP/s (higher is faster)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", help="backends to time (default: every one that runs here)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--plain", nargs="*", default=[], help="kernels to time as plain launches, not captured")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    kernels = args.kernels or available(torch.device("cuda"))
    report = run(kernels, args.cases, args.head_dims, args.repeats, set(args.plain), args.json)
    print(table(report))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
