"""Large images at the hardware's limit (issue 22): the Qwen towers on one big image, a per-kernel breakdown of one
call, and a SigLIP-So400m-size packed encoder on large packed calls, each against eager.

- Towers (``qwen3_vl``, ``qwen2_vl``, ``qwen2_5_vl`` at released sizes, random weights, bf16), served by
  ``compile_vision_tower`` with default options (``attention_backend="auto"``: the kernels installed, timed at the
  build): HF eager (sdpa) and vgraph medians at 1x1344^2 and 1x1792^2, the speed-up, and the MFU
  (``bench.flops.tower_flops`` over the measured bf16 matmul rate). vgraph's output is checked against eager's.
- One 1x1792^2 call of the first tower under the torch profiler: the top kernels by device time, and the time per
  kind (attention, GEMM, Triton/inductor kernels, other).
- ``So400mEncoder`` (27 blocks, width 1152, MLP 4304, 16 heads, tanh GELU, a learned position table; patches of
  14 x 14 x 3) through ``vgraph_compile.encoder`` with default options, against the same module run eagerly.
- With ``--call-choice-mixes N``: the same encoder served twice in one process, ``call_choice="measured"`` and
  ``"smallest_bucket"``, on N random mixes of images: each mix's median per mode and the measured mode's choices,
  written to a second report (``--call-choice-json``).

Each build's ``auto`` kernel timings (every candidate's time per attention group, and the kernel kept) are logged
and kept in the report under ``kernel_timing_log``.

Each part is written to the report as soon as it is measured, so a run cut short keeps what it measured.

    python benchmarks/large_images.py [--towers qwen3_vl qwen2_vl qwen2_5_vl] [--json PATH] [--deadline-s S]
                                      [--call-choice-mixes N --call-choice-json PATH]
    python benchmarks/large_images.py --toy   # tiny towers and encoder on the CPU (checks the script, no timing)
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import vgraph_compile
from vgraph_compile.bench.flops import matmul_peak_tflops, tower_flops
from vgraph_compile.bench.kernel_profile import kernel_breakdown
from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.timing import median_ms
from vgraph_compile.bench.workload import to_grid
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.kernels.ops import varlen_attention
from vgraph_compile.sample_models.vision_utils_towers import build_tower

RESULTS = pathlib.Path(__file__).parent / "results"
CASES_PX = {"1x1344^2": [(1, 1344, 1344)], "1x1792^2": [(1, 1792, 1792)]}
ENCODER_CASES = {
    "1 image, 256 tokens": [256],
    "4x576 tokens": [576] * 4,
    "6 mixed images, 3924 tokens": [1024, 784, 729, 576, 441, 370],
    "1 image, 4096 tokens": [4096],
    "3 large images, 11072 tokens": [4096, 3600, 3376],
}
class KernelTimingLog(logging.Handler):
    """Keeps the messages of ``rewrite.kernel_choice`` (what ``auto`` timed and kept) since the last ``take()``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        source = logging.getLogger("vgraph_compile.rewrite.kernel_choice")
        source.setLevel(logging.INFO)
        source.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        print(record.getMessage(), flush=True)

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, mlp), nn.Linear(mlp, width)

    def forward(self, x, cu_seqlens, max_seqlen):
        rows = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(rows, 3, self.heads, -1).unbind(1)
        x = x + self.proj(varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(rows, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class So400mEncoder(nn.Module):
    """A packed ViT of SigLIP-So400m's size: ``(patches [N, 588], position_ids [N], cu_seqlens, max_seqlen)``."""

    def __init__(self, patch_dim=588, width=1152, depth=27, heads=16, mlp=4304, positions=4096) -> None:
        super().__init__()
        self.embed = nn.Linear(patch_dim, width)
        self.positions = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, patches, position_ids, cu_seqlens, max_seqlen):
        x = self.embed(patches) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen)
        return self.norm(x)


def relative(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def measure_tower(family, device, peak, repeats, warmup, toy, breakdown) -> dict:
    low = build_tower(family, tiny=toy, device=str(device), dtype=torch.bfloat16).eval()
    start = time.perf_counter()
    options = {"compiler": "eager", "min_tokens": 64, "max_tokens": 1024} if toy else {}
    tower = compile_vision_tower(low, max_items=8, max_frames=16, **options)
    with torch.inference_mode():
        tower.warmup()
    torch.cuda.synchronize() if device.type == "cuda" else None
    result = {"warmup_s": round(time.perf_counter() - start, 1), "cases": {}}
    geometry, interface = tower.geometry, tower.interface
    scale = 8 if toy else 1
    for case, items_px in CASES_PX.items():
        items = [(t, h // scale, w // scale) for t, h, w in items_px]
        grid = torch.tensor(to_grid(items, geometry.patch_size, geometry.temporal_patch_size, geometry.spatial_merge_size))
        x = torch.randn(int(grid.prod(-1).sum()), *interface.pixel_shape, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            eager_out = low(x, grid.to(device)).pooler_output
            mine = tower(x, grid).pooler_output
            eager_ms = median_ms(lambda: low(x, grid.to(device)), repeats, warmup, device)
            vgraph_ms = median_ms(lambda: tower(x, grid), repeats, warmup, device)
            flops = tower_flops(low, grid.tolist(), interface)
            if breakdown and case == "1x1792^2" and device.type == "cuda":
                result["kernel_breakdown_1x1792^2"] = kernel_breakdown(lambda: tower(x, grid))
        result["cases"][case] = {
            "patches": int(grid.prod(-1).sum()),
            "hf_eager_sdpa_ms": round(eager_ms, 2),
            "vgraph_ms": round(vgraph_ms, 2),
            "speedup": round(eager_ms / vgraph_ms, 3),
            "vgraph_vs_eager_rel_error": round(relative(mine, eager_out), 5),
            "flops": flops,
            "mfu": round(flops / vgraph_ms / 1e9 / peak, 3) if peak else None,
            "eager_mfu": round(flops / eager_ms / 1e9 / peak, 3) if peak else None,
        }
    result["stats"] = tower.stats_table()
    del tower, low
    return result


def encoder_args(lengths: list[int], device, generator: torch.Generator) -> tuple:
    """``So400mEncoder``'s call for images of ``lengths`` tokens: random patches, per-image positions, offsets."""
    patches = torch.randn(sum(lengths), 588, generator=generator).to(device, torch.bfloat16)
    positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device, torch.int32)
    return patches, positions, cu, max(lengths)


def measure_call_choice(device, repeats, warmup, toy, mixes) -> dict:
    """The So400m-size encoder served with ``call_choice="measured"`` and ``"smallest_bucket"`` on ``mixes`` random
    image mixes (1-6 images of 64-4,096 tokens): per mix, both medians, the measured mode's choices (counted over
    its calls of that mix) and each mode's error against eager."""
    sizes = dict(width=64, depth=2, heads=4, mlp=96, positions=4096) if toy else {}
    model = So400mEncoder(**sizes).to(device, torch.bfloat16).eval()
    options = {"compiler": "eager", "max_tokens": 1024} if toy else {}
    served = {
        mode: vgraph_compile.encoder(model, call_choice=mode, **options) for mode in ("measured", "smallest_bucket")
    }
    draw, counter = random.Random(0), torch.Generator().manual_seed(1)
    most = 256 if toy else 4096
    result: dict = {"mixes": []}
    for _ in range(mixes):
        lengths = [draw.randint(16 if toy else 64, most) for _ in range(draw.randint(1, 6))]
        args = encoder_args(lengths, device, counter)
        entry: dict = {"lengths": lengths, "tokens": sum(lengths)}
        with torch.inference_mode():
            ref = model(*args)
            for mode, fn in served.items():
                runtimes = fn.vgraph.runtimes
                before = collections.Counter()
                for runtime in runtimes:
                    before.update(runtime.choices)
                out = fn(*args)
                entry[f"{mode}_ms"] = round(median_ms(lambda: fn(*args), repeats, warmup, device), 3)
                entry[f"{mode}_vs_eager_rel_error"] = round(relative(out, ref), 5)
                if mode == "measured":
                    after = collections.Counter()
                    for runtime in fn.vgraph.runtimes:
                        after.update(runtime.choices)
                    entry["measured_choices"] = dict(after - before)
        entry["measured_over_smallest_bucket"] = round(entry["measured_ms"] / entry["smallest_bucket_ms"], 3)
        print(entry, flush=True)
        result["mixes"].append(entry)
    ratios = sorted(entry["measured_over_smallest_bucket"] for entry in result["mixes"])
    result["median_measured_over_smallest_bucket"] = ratios[len(ratios) // 2] if ratios else None
    result["stats"] = {
        mode: "\n".join(runtime.stats_table() for runtime in fn.vgraph.runtimes) for mode, fn in served.items()
    }
    return result


def measure_encoder(device, peak, repeats, warmup, toy) -> dict:
    sizes = dict(width=64, depth=2, heads=4, mlp=96, positions=4096) if toy else {}
    model = So400mEncoder(**sizes).to(device, torch.bfloat16).eval()
    options = {"compiler": "eager", "max_tokens": 1024} if toy else {}
    served = vgraph_compile.encoder(model, **options)
    result = {"cases": {}}
    counter = torch.Generator().manual_seed(0)
    for case, lengths in ENCODER_CASES.items():
        if toy:
            lengths = [max(length // 16, 8) for length in lengths]
        rows = sum(lengths)
        args = encoder_args(lengths, device, counter)
        with torch.inference_mode():
            start = time.perf_counter()
            mine = served(*args)
            first_s = time.perf_counter() - start
            ref = model(*args)
            eager_ms = median_ms(lambda: model(*args), repeats, warmup, device)
            vgraph_ms = median_ms(lambda: served(*args), repeats, warmup, device)
        width, depth, mlp = model.norm.normalized_shape[0], len(model.blocks), model.blocks[0].fc1.out_features
        flops = 2 * rows * (588 * width + depth * (4 * width * width + 2 * width * mlp))
        flops += depth * 4 * sum(length * length for length in lengths) * width
        result["cases"][case] = {
            "tokens": rows,
            "eager_ms": round(eager_ms, 2),
            "vgraph_ms": round(vgraph_ms, 2),
            "eager_over_vgraph": round(eager_ms / vgraph_ms, 3),
            "vgraph_vs_eager_rel_error": round(relative(mine, ref), 5),
            "first_call_s": round(first_s, 1),
            "flops": flops,
            "mfu": round(flops / vgraph_ms / 1e9 / peak, 3) if peak else None,
        }
    result["stats"] = "\n".join(runtime.stats_table() for runtime in served.vgraph.runtimes)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", nargs="*", default=["qwen3_vl", "qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--no-encoder", action="store_true", help="skip the So400m-size encoder")
    parser.add_argument("--json", help="report path (default: benchmarks/results/large_images_<device>.json)")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no new part after this many seconds")
    parser.add_argument("--toy", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--call-choice-mixes", type=int, default=0, help="random mixes for the call_choice part")
    parser.add_argument("--call-choice-json", help="report path of the call_choice part")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    timing_log = KernelTimingLog()
    device = torch.device("cpu" if args.toy else "cuda")
    repeats, warmup = (1, 0) if args.toy else (20, 3)
    peak = None if args.toy else matmul_peak_tflops()
    tag = "cpu" if args.toy else torch.cuda.get_device_name().split()[-1].lower()
    path = args.json or str(RESULTS / f"large_images_{tag}.json")
    report = {
        "device": "cpu" if args.toy else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bf16_matmul_peak_tflops": round(peak, 1) if peak else None,
        "towers": {},
        "skipped": [],
    }
    for index, family in enumerate(args.towers):
        if time.perf_counter() - begin > args.deadline_s:
            report["skipped"].append(family)
            continue
        report["towers"][family] = measure_tower(family, device, peak, repeats, warmup, args.toy, index == 0)
        report["towers"][family]["kernel_timing_log"] = timing_log.take()
        print(family, report["towers"][family]["cases"], flush=True)
        write_report(report, path)
    if not args.no_encoder:
        if time.perf_counter() - begin > args.deadline_s:
            report["skipped"].append("so400m_encoder")
        else:
            report["so400m_encoder"] = measure_encoder(device, peak, repeats, warmup, args.toy)
            report["so400m_encoder"]["kernel_timing_log"] = timing_log.take()
            print(report["so400m_encoder"]["cases"], flush=True)
    write_report(report, path)
    if args.call_choice_mixes:
        if time.perf_counter() - begin > args.deadline_s:
            report["skipped"].append("call_choice")
        else:
            choice = {"device": report["device"], "torch": report["torch"], "encoder": "So400mEncoder"}
            choice.update(measure_call_choice(device, repeats, warmup, args.toy, args.call_choice_mixes))
            choice["kernel_timing_log"] = timing_log.take()
            write_report(choice, args.call_choice_json)
            report["call_choice"] = args.call_choice_json
            write_report(report, path)
    return report


if __name__ == "__main__":
    main()
