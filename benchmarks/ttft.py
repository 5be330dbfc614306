"""Time to first token of a whole VLM, stock transformers vs ``compile_vlm``, on seeded random requests.

Models: Qwen2.5-VL-7B or Qwen3-VL-8B (packed towers), InternVL3-1B (a fixed-tile tower: InternViT-300M on 448 px
tiles), or the VLM of any served ``vision_utils`` family (``--model paddleocr_vl``, built from its own config class:
``vgraph_compile.sample_models.vision_utils_vlms``), at their released sizes (random weights, bf16, sdpa for the language model;
no download). Requests: 1-4 real photographs (scikit-image's samples) resized to varied resolutions, some with a
video clip (Qwen models only), and 20-300 text tokens, made into model inputs by transformers' Qwen2-VL image
processor (``vgraph_compile.sample_models.qwen_vlms``), InternVL's tile processor (``vgraph_compile.sample_models.tile_vlms``) or
the family's own (images, one prompt per request). Per system: ``generate(max_new_tokens=1)`` (TTFT p50/p99), the
vision tower's share of it, ``generate(max_new_tokens=32)`` (decode tokens/s), warm-up time and peak memory. Each system
warms up over the requests; then every request is measured under both, their order alternating per request, and the
last-position logits of the first requests are compared with a float32 copy of the stock model.
``vision_time_removed``: the share of the stock tower's time (summed over the requests) that vgraph's tower saves.
``stock_vision_removed_from_ttft``: ``(stock TTFT p50 - vgraph TTFT p50) / stock vision p50``, the share of the stock
tower's time that vgraph takes off the time to first token (the measure that transfers across models).

    python benchmarks/ttft.py --model qwen2.5-vl --json benchmarks/results/ttft_qwen2.5-vl_h200.json --plot ttft.png
    python benchmarks/ttft.py --model internvl3-1b --json benchmarks/results/ttft_internvl3-1b_h200.json
    python benchmarks/ttft.py --model paddleocr_vl --json benchmarks/results/ttft_paddleocr_vl_h200.json
    python benchmarks/ttft.py --tiny          # a tiny random model on the CPU: checks the whole flow in seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from typing import Any

import torch

from vgraph_compile.bench.report import write_report
from vgraph_compile.bench.result import Result
from vgraph_compile.bench.timing import synchronize
from vgraph_compile.hf import compile_vlm
from vgraph_compile.hf.vlm import find_vision_tower
from vgraph_compile.sample_models import vision_utils_vlms
from vgraph_compile.sample_models.qwen_vlms import (
    Item,
    Request,
    image_processor,
    model_inputs,
    photos,
    qwen_vlm,
    resized,
    video_clip,
)
from vgraph_compile.sample_models.tile_vlms import internvl, tile_inputs, tile_processor

QWEN = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
TILE_MODELS = {"internvl3-1b": dict(real=dict(max_items=32), tiny=dict(max_items=8, compiler="eager"))}
"""Fixed-tile VLMs: vgraph options, released sizes and tiny."""

SETTINGS = {
    "real": dict(
        sides=(224, 1024),
        video=dict(frames=8, size=(336, 336)),
        max_patches=None,
        decode_tokens=32,
        options=dict(max_items=8, max_frames=16),
    ),
    "tiny": dict(
        sides=(56, 160),
        video=dict(frames=4, size=(112, 112)),
        max_patches=128,
        decode_tokens=4,
        options=dict(token_budgets=[128, 512], max_items=4, compiler="eager", attention_backend="sdpa"),
    ),
}


def random_requests(seed: int, requests: int, sides: tuple[int, int], video: dict | None) -> list[Request]:
    """Seeded requests: 1-4 photos (each resized to sides in ``sides``), a video clip in one request of four (none
    when ``video`` is None), 20-300 text tokens split around the items."""
    rng = random.Random(seed)
    photo = photos()
    names = sorted(photo)
    out = []
    for index in range(requests):
        items = [
            Item("image", photo[rng.choice(names)], (rng.randrange(*sides), rng.randrange(*sides)))
            for _ in range(rng.randint(1, 4))
        ]
        if rng.random() < 0.25 and video is not None:
            items.insert(rng.randrange(len(items) + 1), Item("video", video_clip(photo[rng.choice(names)], **video)))
        total = rng.randint(20, 300)
        cuts = sorted(rng.randint(0, total) for _ in range(len(items)))
        text = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        out.append(Request(tuple(items), tuple(text), seed=seed * 1000 + index))
    return out


class VisionTimer:
    """Time spent in the vision tower per request: CUDA events recorded by forward hooks (no sync in between)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.handles = [
            module.register_forward_pre_hook(lambda *_: self.spans.append((self._now(), None))),
            module.register_forward_hook(lambda *_: self.spans.append((self.spans.pop()[0], self._now()))),
        ]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_ms(self) -> float:
        spans, self.spans = self.spans, []
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans)
        return sum(1e3 * (end - start) for start, end in spans)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class TokenClock:
    """A ``generate`` streamer that notes when each batch of tokens reaches the host (the prompt first, then one
    per step; generate copies each step's tokens to the host before handing them over, so the times are exact)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_tokens_per_s(self, batch: int) -> float:
        """Tokens per second after the first new token: steps 2..n over the time they took."""
        steps = self.times[1:]
        return (len(steps) - 1) * batch / (steps[-1] - steps[0])


def timed_generate(model, inputs: dict, new_tokens: int, device: torch.device, streamer=None):
    """``(tokens, milliseconds)`` of a greedy ``generate`` of exactly ``new_tokens`` tokens."""
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=streamer
    )
    synchronize(device)
    return out, 1e3 * (time.perf_counter() - start)


CHECKED = 4
"""Requests whose last-position logits are compared against the float32 reference."""


def last_logits(model, batches: list[dict]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(**inputs).logits[:, -1].float() for inputs in batches]


def float32_reference(model, batches: list[dict]) -> list[torch.Tensor]:
    """The stock model's last-position logits computed by a float32 copy of it (the model itself is untouched:
    a round trip through float32 would also cast its float32 buffers, such as the rotary frequencies)."""
    return last_logits(copy.deepcopy(model).float(), batches)


def relative_error(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest ``max|a - b| / max|b|`` over the requests."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, reference))


def warm_up(model, batches: list[dict], decode_tokens: int, device: torch.device, prepare) -> dict[str, Any]:
    """``prepare()`` (compile or nothing), then the requests once with one new token and a few requests with
    ``decode_tokens``: the time to the first token of the first request, and the peak memory of the whole."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    prepare()
    with torch.inference_mode():
        timed_generate(model, batches[0], 1, device)
        first_s = time.perf_counter() - start
        for inputs in batches[1:]:
            timed_generate(model, inputs, 1, device)
        for inputs in batches[:CHECKED]:
            timed_generate(model, inputs, decode_tokens, device)
    return {
        "warmup_s": round(first_s, 2),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }


def measure(model, towers: dict[str, torch.nn.Module], batches: list[dict], decode_tokens: int, device) -> dict:
    """Every request under every system, the systems' order alternating per request (the vision tower swapped in
    place), so drift in clocks or allocator state falls on both alike."""
    owner, attribute = find_vision_tower(model)
    timers = {name: VisionTimer(tower, device) for name, tower in towers.items()}
    samples = {name: {"ttft": [], "vision": [], "decode": [], "tokens": []} for name in towers}
    try:
        with torch.inference_mode():
            for index, inputs in enumerate(batches):
                for name in sorted(towers, reverse=index % 2 == 1):
                    setattr(owner, attribute, towers[name])
                    sample = samples[name]
                    out, ms = timed_generate(model, inputs, 1, device)
                    sample["ttft"].append(ms)
                    sample["vision"].append(timers[name].take_ms())
                    sample["tokens"].append(out[:, -1].tolist())
                    clock = TokenClock()
                    timed_generate(model, inputs, decode_tokens, device, clock)
                    timers[name].take_ms()
                    sample["decode"].append(clock.decode_tokens_per_s(len(out)))
    finally:
        for timer in timers.values():
            timer.remove()
    report = {}
    for name, sample in samples.items():
        setattr(owner, attribute, towers[name])
        ttft, vision = sample["ttft"], sample["vision"]
        latency = Result(latencies_ms=ttft).summary()
        report[name] = {
            "ttft_p50_ms": latency["p50_ms"],
            "ttft_p99_ms": latency["p99_ms"],
            "ttft_mean_ms": latency["mean_ms"],
            "vision_p50_ms": round(statistics.median(vision), 2),
            "vision_total_ms": round(sum(vision), 2),
            "vision_share": round(sum(vision) / sum(ttft), 3),
            "decode_tokens_per_s_p50": round(statistics.median(sample["decode"]), 1),
            "ttft_ms": [round(ms, 2) for ms in ttft],
            "first_tokens": sample["tokens"],
            "_logits": last_logits(model, batches[:CHECKED]),
        }
    return report


def run(args) -> dict[str, Any]:
    device = torch.device(args.device)
    setting = SETTINGS["tiny" if args.tiny else "real"]
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    tiles = args.model in TILE_MODELS
    options = TILE_MODELS[args.model]["tiny" if args.tiny else "real"] if tiles else setting["options"]
    model, requests, batches = build(args, setting, device, dtype)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": f"{args.model} {'tiny' if args.tiny else 'released sizes'}, random weights, {dtype}, sdpa",
        "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "images": sum(1 for r in requests for i in r.items if i.kind == "image"),
            "videos": sum(1 for r in requests for i in r.items if i.kind == "video"),
            "prompt_tokens_p50": statistics.median(b["input_ids"].shape[1] for b in batches),
            ("tiles_p50" if tiles else "patches_p50"): statistics.median(
                b["pixel_values"].shape[0] if tiles
                else sum(int(b[g].prod(-1).sum()) for g in ("image_grid_thw", "video_grid_thw") if g in b)
                for b in batches
            ),
            "decode_tokens": setting["decode_tokens"],
        },
        "vgraph_options": options,
        "systems": {},
    }
    reference = float32_reference(model, batches[:CHECKED]) if dtype != torch.float32 else None
    owner, attribute = find_vision_tower(model)
    stock = getattr(owner, attribute)
    warmed = {
        "hf": warm_up(model, batches, setting["decode_tokens"], device, lambda: None),
        "vgraph": warm_up(model, batches, setting["decode_tokens"], device, lambda: compile_vlm(model, **options)),
    }
    towers = {"hf": stock, "vgraph": getattr(owner, attribute)}
    measured = measure(model, towers, batches, setting["decode_tokens"], device)
    report["systems"] = {name: {**measured[name], **warmed[name]} for name in warmed}
    hf, vgraph = report["systems"]["hf"], report["systems"]["vgraph"]
    hf_logits, vgraph_logits = hf.pop("_logits"), vgraph.pop("_logits")
    report["last_logits_max_rel_diff"] = relative_error(vgraph_logits, hf_logits)
    if reference is not None:
        report["last_logits_vs_float32"] = {
            "requests": CHECKED,
            "hf": relative_error(hf_logits, reference),
            "vgraph": relative_error(vgraph_logits, reference),
        }
    report["first_tokens_equal"] = sum(a == b for a, b in zip(hf["first_tokens"], vgraph["first_tokens"]))
    report["ttft_p50_ratio"] = round(vgraph["ttft_p50_ms"] / hf["ttft_p50_ms"], 3)
    report["vision_time_removed"] = round(1 - vgraph["vision_total_ms"] / hf["vision_total_ms"], 3)
    report["stock_vision_removed_from_ttft"] = round(
        (hf["ttft_p50_ms"] - vgraph["ttft_p50_ms"]) / hf["vision_p50_ms"], 3
    )
    report["vgraph_buckets"] = towers["vgraph"].stats_table()
    return report


def build(args, setting: dict, device: torch.device, dtype: torch.dtype) -> tuple[Any, list[Request], list[dict]]:
    """(the model, its requests, each request's model inputs): a Qwen model with the Qwen2-VL processor, InternVL
    with its tile processor, or a family's VLM with the family's own processor (images only, one prompt per
    request)."""
    if args.model in TILE_MODELS:
        model = internvl(tiny=args.tiny, device=device, dtype=dtype, seed=args.seed)
        processor = tile_processor(model)
        requests = random_requests(args.seed, args.requests, setting["sides"], None)
        return model, requests, [tile_inputs(model, request, processor, device) for request in requests]
    if args.model in QWEN:
        model = qwen_vlm(args.model, tiny=args.tiny, device=device, dtype=dtype, seed=args.seed)
        processor = image_processor(model.config, max_patches=setting["max_patches"])
        requests = random_requests(args.seed, args.requests, setting["sides"], setting["video"])
        return model, requests, [model_inputs(model, [request], processor, device) for request in requests]
    model = vision_utils_vlms.build_vlm(args.model, tiny=args.tiny, device=str(device), dtype=dtype, seed=args.seed)
    processor = vision_utils_vlms.image_processor(args.model, model)
    requests = random_requests(args.seed, args.requests, setting["sides"], None)
    batches = [
        vision_utils_vlms.image_inputs(
            model, processor, [resized(item.pixels, item.resize_to) for item in request.items],
            text_tokens=max(1, sum(request.text_tokens) // (len(request.items) + 1)), seed=request.seed,
        )
        for request in requests
    ]
    return model, requests, batches


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError as missing:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for name, system in report["systems"].items():
        times = sorted(system["ttft_ms"])
        axis.plot(
            times, [(i + 1) / len(times) for i in range(len(times))], label=f"{name} (p50 {system['ttft_p50_ms']} ms)"
        )
    axis.set_xlabel("time to first token, ms")
    axis.set_ylabel("fraction of requests")
    axis.set_title(f"{report['model']} on {report['device']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="qwen2.5-vl",
        help=f"{', '.join(QWEN)}, {', '.join(TILE_MODELS)}, or a served vision_utils family (paddleocr_vl)",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny random model, fp32 (CPU smoke run)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--device", default=None, help="default: cuda when present (cpu with --tiny)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    report = run(args)
    summary = {
        name: {k: v for k, v in s.items() if k not in ("ttft_ms", "first_tokens")}
        for name, s in report["systems"].items()
    }
    print(
        json.dumps({**{k: v for k, v in report.items() if k not in ("systems", "vgraph_buckets")}, **summary}, indent=1)
    )
    print(report["vgraph_buckets"])
    write_report(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
