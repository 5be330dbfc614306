"""Time to first token under concurrent load, over HTTP: transformers' own OpenAI-compatible server (``transformers
serve``) stock, then ``vgraph serve`` (started from ``vgraph precompile``'s plans), on the same local checkpoint.

Model: Qwen2.5-VL-7B or InternVL3-1B at released sizes (random weights, bf16), saved with its processor by
``vgraph_compile.sample_models.checkpoints``; ``--tiny``: a tiny one in float32 (PaddleOCR-VL on a CPU without
torchvision). Requests: the real-photo mix of ``benchmarks/ttft.py`` (1-4 of scikit-image's sample photos resized to
varied sides, 20-300 text tokens; no videos), sent as JPEG data URLs and streamed, greedy, ``--new-tokens`` each,
through the ``openai`` client by 1, 4 and 16 concurrent clients; the server's own processor turns them into pixels.
Per system and concurrency: TTFT p50/p99 (request sent to first content chunk), requests per second, the
tower's share (its time, synchronized at entry and exit, over the level's wall time), and the mean request's TTFT
broken down (``breakdown``: the processor with its image decode, the prefill and the tower inside it, and the rest:
HTTP and JSON, the wait for the server's one generate thread, the first token's trip back); per system the
start-up (process start to ``/health`` answering; vgraph: and the precompile) and the TTFT of the first two
requests after readiness (``first_requests_ttft_ms``, not in any level). Both servers get the same requests: the
answers (their token words) are compared request by request.

The server processes run this file with ``--serve``: transformers' ``Serve`` with ``ModelManager`` (stock) or
``vgraph_compile.hf.server.manager_class`` (vgraph), each extended with the server clock only (``ServerClock``).

    python benchmarks/serve_load.py --model qwen2.5-vl       # ~5 min on an H100: checkpoint, stock, precompile, vgraph
    python benchmarks/serve_load.py --model internvl3-1b
    python benchmarks/serve_load.py --merge a.json b.json --json benchmarks/results/serve_load_h100.json  # table, plot
    python benchmarks/serve_load.py --tiny --model paddleocr_vl --clients 1 4 --requests 4   # CPU smoke run

The JSON (``--json``, default ``benchmarks/results/serve_load_<device>.json``) holds one entry per model, written
after each system; the plot (next to it, ``.png``) shows TTFT p50 and p99 against concurrency, one panel a model.

On a machine with transformers < 5.23 or without FastAPI/uvicorn/openai and no network, carry the wheels of
``scripts/serve_wheels.txt`` (``pip download --only-binary=:all: --no-deps --python-version 3.12 --platform
manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -r scripts/serve_wheels.txt -d .whl``, 20 MB) and put them
first on the path (the lent GPU machines have transformers 5.17, no FastAPI, uvicorn, openai or pydantic):

    python3 -m pip install -q --no-index --no-deps --target /tmp/serve_site .whl/*.whl && \
    PYTHONPATH=/tmp/serve_site:$PWD python3 benchmarks/serve_load.py --model qwen2.5-vl --work /tmp/serve_load \
        --json $OUT/serve_load_qwen2.5-vl.json
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import functools
import io
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
VGRAPH_OPTIONS = {
    "qwen2.5-vl": ["--max-items", "8", "--max-frames", "16"],
    "internvl3-1b": ["--max-items", "32"],
}
"""vgraph's options per model, as benchmarks/ttft.py's."""
TINY_OPTIONS = ["--budgets", "128", "512", "--max-items", "4", "--options", '{"compiler": "eager"}']


# -- the server side (``--serve``) ----------------------------------------------------------------------------
class ServerClock:
    """Where a server's time goes, as totals and counts rewritten to a JSON file after every span: ``processor``
    (the chat template with its images: decode, resize, tokens), ``prefill`` (each ``generate`` from its start to
    the end of its first forward, the device synchronized there: the tower's call inside it) and ``tower`` (its
    forward, the device synchronized at entry and exit). transformers' server runs one ``generate`` at a time on
    one thread, so a request's prefill is never another's."""

    def __init__(self, path: str, cuda: bool) -> None:
        self.path, self.cuda = path, cuda
        self.totals: dict[str, float] = {name: 0.0 for name in SPANS}
        self.counts: dict[str, int] = {name: 0 for name in SPANS}
        self.lock, self.local = threading.Lock(), threading.local()
        self._write()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def add(self, name: str, start: float) -> None:
        with self.lock:
            self.totals[name] += 1e3 * (time.perf_counter() - start)
            self.counts[name] += 1
            self._write()

    def _write(self) -> None:
        spans = {name: {"ms": self.totals[name], "calls": self.counts[name]} for name in SPANS}
        Path(self.path).write_text(json.dumps(spans))

    def install(self, model: torch.nn.Module, processor: Any, tower: torch.nn.Module) -> None:
        """Wrap ``processor.apply_chat_template``, ``model.generate`` and ``model.forward``, and hook ``tower``."""
        clock, local = self, self.local
        template, generate, forward = processor.apply_chat_template, model.generate, model.forward

        @functools.wraps(template)
        def timed_template(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return template(*args, **kwargs)
            finally:
                clock.add("processor", start)

        @functools.wraps(generate)
        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            local.generate_start = time.perf_counter()
            return generate(*args, **kwargs)

        @functools.wraps(forward)  # generate reads the forward's signature
        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            start = getattr(local, "generate_start", None)
            if start is not None:  # the first forward of a generate: its prefill
                local.generate_start = None
                clock.sync()
                clock.add("prefill", start)
            return out

        def enter(*_: Any) -> None:
            clock.sync()
            local.tower_start = time.perf_counter()

        def exit_(*_: Any) -> None:
            clock.sync()
            clock.add("tower", local.tower_start)

        processor.apply_chat_template = timed_template
        model.generate, model.forward = timed_generate, timed_forward
        tower.register_forward_pre_hook(enter)
        tower.register_forward_hook(exit_)


SPANS = ("processor", "prefill", "tower")
"""The spans a ``ServerClock`` times."""


def clocked(manager: type, path: str) -> type:
    """``manager`` whose models carry a ``ServerClock`` writing to ``path`` (installed once, after the manager's own
    loading: after vgraph's warm-up)."""
    from vgraph_compile.hf.vlm import find_vision_tower

    class ClockedManager(manager):
        def load_model_and_processor(self, *args: Any, **kwargs: Any):
            model, processor = super().load_model_and_processor(*args, **kwargs)
            if not hasattr(model, "_server_clock"):
                owner, attribute = find_vision_tower(model)
                tower = getattr(owner, attribute)
                model._server_clock = ServerClock(path, next(tower.parameters()).is_cuda)
                model._server_clock.install(model, processor, tower)
            return model, processor

    return ClockedManager


def serve_main(system: str, clock_path: str, arguments: list[str], vgraph_arguments: list[str]) -> None:
    from vgraph_compile import cli
    from vgraph_compile.hf import server

    if system == "vgraph":
        parser = argparse.ArgumentParser()
        cli.add_vgraph_options(parser)
        cli.log_to_stderr()
        manager = server.manager_class(cli.vgraph_options(parser.parse_args(vgraph_arguments)))
    else:
        manager = server.hook_point()[1]
    server.serve(arguments, clocked(manager, clock_path))


# -- the client side ------------------------------------------------------------------------------------------
def payloads(model: str, requests: int, seed: int, tiny: bool) -> list[list[dict]]:
    """The message content of each request: ``ttft.random_requests``' photos (JPEG data URLs) and text words."""
    import random

    sys.path.insert(0, str(Path(__file__).parent))
    from PIL import Image
    from ttft import SETTINGS, random_requests

    from vgraph_compile.sample_models.qwen_vlms import resized

    sides = SETTINGS["tiny" if tiny else "real"]["sides"]
    out = []
    for request in random_requests(seed, requests, sides, None):
        rng = random.Random(request.seed)
        content: list[dict] = []
        for index, count in enumerate(request.text_tokens):
            words = " ".join(f"t{rng.randrange(1000)}" for _ in range(count))
            if words:
                content.append({"type": "text", "text": words})
            if index < len(request.items):
                buffer = io.BytesIO()
                item = request.items[index]
                Image.fromarray(resized(item.pixels, item.resize_to)).save(buffer, format="JPEG", quality=95)
                url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
                content.append({"type": "image_url", "image_url": {"url": url}})
        out.append(content)
    return out


def stream(port: int, model: str, content: list[dict], new_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: TTFT (to the first content chunk), total time, the answer."""
    import openai

    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    first, text = None, ""
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True, max_tokens=new_tokens,
        temperature=0,
    )  # fmt: skip
    for chunk in chunks:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter()
            text += delta
    end = time.perf_counter()
    return {"ttft_ms": 1e3 * ((first or end) - start), "total_ms": 1e3 * (end - start), "answer": text}


def load_level(port: int, model: str, requests: list[list[dict]], clients: int, new_tokens: int, clock: Path):
    """``requests`` sent by ``clients`` concurrent clients (each takes the next unsent one): per-request records,
    requests per second, the tower's share of the wall time, and the mean request's TTFT broken down
    (``breakdown``)."""
    before = json.loads(clock.read_text())
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        records = list(pool.map(lambda content: stream(port, model, content, new_tokens), requests))
    wall = time.perf_counter() - start
    after = json.loads(clock.read_text())
    ttft = sorted(record["ttft_ms"] for record in records)
    return {
        "requests": len(records),
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p99_ms": round(ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 1),
        "requests_per_s": round(len(records) / wall, 3),
        "tower_share": round((after["tower"]["ms"] - before["tower"]["ms"]) / (1e3 * wall), 3),
        "tower_calls": after["tower"]["calls"] - before["tower"]["calls"],
        "breakdown": breakdown(before, after, statistics.mean(ttft)),
        "ttft_ms": [round(value["ttft_ms"], 1) for value in records],
        "answers": [record["answer"] for record in records],
    }


def breakdown(before: dict, after: dict, mean_ttft_ms: float) -> dict[str, float]:
    """The mean request's TTFT in ms: ``processor`` (chat template, image decode, tokens), ``prefill`` (generate's
    start to its first forward's end) of which ``tower``, and ``rest``: the mean TTFT less the two (HTTP and JSON
    both ways, the wait for the one generate thread, the first token's trip to the client)."""

    def per_request(name: str) -> float:
        calls = after[name]["calls"] - before[name]["calls"]
        return (after[name]["ms"] - before[name]["ms"]) / calls if calls else 0.0

    requests = max(1, after["prefill"]["calls"] - before["prefill"]["calls"])
    processor, prefill = per_request("processor"), per_request("prefill")
    tower = (after["tower"]["ms"] - before["tower"]["ms"]) / requests
    return {
        "processor": round(processor, 2),
        "prefill": round(prefill, 2),
        "tower": round(tower, 2),
        "rest": round(mean_ttft_ms - processor - prefill, 2),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """This file's ``--serve`` in a child process on a free port, its output in ``log``; ``startup_s``: from the
    process start to ``/health`` answering."""

    def __init__(self, system: str, model_dir: str, serve_args: list[str], vgraph_args: list[str], work: Path):
        self.port, self.log, self.clock = _free_port(), work / f"{system}.log", work / f"{system}.clock.json"
        argv = [sys.executable, __file__, "--serve", system, str(self.clock), model_dir, *serve_args]
        argv += ["--port", str(self.port), "--vgraph", *vgraph_args]
        self.started = time.perf_counter()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.startup_s = self._wait_ready()

    def _wait_ready(self, timeout: float = 420) -> float:
        while time.perf_counter() - self.started < timeout:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://localhost:{self.port}/health", timeout=1):
                    return round(time.perf_counter() - self.started, 1)
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise SystemExit(f"no server after {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.log.read_text()


def run_system(system, model_dir, serve_args, vgraph_args, requests, args, work) -> dict[str, Any]:
    server = ServerProcess(system, model_dir, serve_args, vgraph_args, work)
    try:  # the first two requests after readiness, kept apart (the stock model's first calls choose kernels)
        first = [stream(server.port, model_dir, content, args.new_tokens)["ttft_ms"] for content in requests[:2]]
        levels = {
            str(clients): load_level(
                server.port, model_dir, requests[: max(args.requests, 4 * clients)], clients, args.new_tokens,
                server.clock,
            )  # fmt: skip
            for clients in args.clients
        }
    finally:
        log = server.stop()
    logged = re.search(r"ready, start-up ([\d.]+) s", log)
    buckets = re.search(r"vision tower buckets:\n(.*?)\n(?:INFO|\[transformers\])", log, re.S)
    return {
        "startup_s": server.startup_s,
        "startup_logged_s": float(logged.group(1)) if logged else None,
        "first_requests_ttft_ms": [round(ms, 1) for ms in first],
        "levels": levels,
        "buckets": buckets.group(1) if buckets else None,
    }


def precompile(model_dir: str, serve_args: list[str], vgraph_args: list[str], work: Path) -> float:
    start = time.perf_counter()
    argv = [sys.executable, "-m", "vgraph_compile.cli", "precompile", model_dir, *vgraph_args, *serve_args]
    with open(work / "precompile.log", "w") as log:
        code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"vgraph precompile failed:\n{(work / 'precompile.log').read_text()[-4000:]}")
    return round(time.perf_counter() - start, 1)


def device_tag(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return next((tag for tag in ("h200", "h100", "b200", "a100") if tag in name), re.sub(r"\W+", "_", name))


def run(args, save) -> dict[str, Any]:
    """The checkpoint, then each system in turn; ``save(report)`` after each (a run cut short keeps the first)."""
    import transformers

    from vgraph_compile.sample_models.checkpoints import save_checkpoint

    work = Path(args.work or tempfile.mkdtemp(prefix="serve_load_"))
    model_dir = work / args.model
    dtype = "float32" if args.tiny else "bfloat16"
    start = time.perf_counter()
    if not (model_dir / "config.json").exists():
        save_checkpoint(args.model, model_dir, tiny=args.tiny, dtype=getattr(torch, dtype), device=args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    saved_s = round(time.perf_counter() - start, 1)
    serve_args = ["--device", args.device, "--dtype", dtype]
    options = TINY_OPTIONS if args.tiny else VGRAPH_OPTIONS.get(args.model, [])
    vgraph_args = [*options, "--artifact-dir", str(work / "artifacts")]
    requests = payloads(args.model, max(args.requests, 4 * max(args.clients)), args.seed, args.tiny)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"{args.model} {'tiny, float32' if args.tiny else 'released sizes, bfloat16'}, random weights",
        "workload": {
            "requests_per_level": {str(c): max(args.requests, 4 * c) for c in args.clients},
            "seed": args.seed,
            "new_tokens": args.new_tokens,
            "images": sum(1 for r in requests for part in r if part["type"] == "image_url"),
        },
        "vgraph_options": options,
        "checkpoint_saved_s": saved_s,
        "systems": {},
    }
    report["systems"]["hf"] = run_system("stock", str(model_dir), serve_args, [], requests, args, work)
    save(report)
    precompile_s = precompile(str(model_dir), serve_args, vgraph_args, work)
    report["systems"]["vgraph"] = run_system("vgraph", str(model_dir), serve_args, vgraph_args, requests, args, work)
    report["systems"]["vgraph"]["precompile_s"] = precompile_s
    report.update(compare(report["systems"]["hf"], report["systems"]["vgraph"]))
    return report


def compare(hf: dict[str, Any], vgraph: dict[str, Any]) -> dict[str, Any]:
    """Per level: answers equal to the stock server's (whole answers, first tokens), the TTFT ratios; the extra
    start-up."""

    def count(same) -> dict[str, str]:
        levels = hf["levels"]
        pairs = {level: zip(levels[level]["answers"], vgraph["levels"][level]["answers"]) for level in levels}
        return {level: f"{sum(same(a, b) for a, b in pairs[level])}/{levels[level]['requests']}" for level in levels}

    def ratio(key: str) -> dict[str, float]:
        return {level: round(vgraph["levels"][level][key] / row[key], 3) for level, row in hf["levels"].items()}

    return {
        "answers_equal": count(lambda a, b: a == b),
        "first_tokens_equal": count(lambda a, b: a.split()[:1] == b.split()[:1]),
        "ttft_p50_ratio": ratio("ttft_p50_ms"),
        "ttft_p99_ratio": ratio("ttft_p99_ms"),
        "startup_extra_s": round(vgraph["startup_s"] - hf["startup_s"], 1),
    }


def table(models: dict[str, Any]) -> str:
    """One markdown table: per model and concurrency, TTFT p50/p99, requests/s and tower share, stock -> vgraph."""
    lines = [
        "| model | clients | TTFT p50 ms | TTFT p99 ms | requests/s | tower share | answers equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, report in models.items():
        if "vgraph" not in report["systems"]:  # a run cut short after the stock server
            continue
        hf, vgraph = report["systems"]["hf"]["levels"], report["systems"]["vgraph"]["levels"]
        for level in hf:
            cells = [
                f"{hf[level][key]} → {vgraph[level][key]}"
                for key in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "tower_share")
            ]
            lines.append(f"| {model} | {level} | {' | '.join(cells)} | {report['answers_equal'][level]} |")
    lines += [
        "",
        "| model | clients | processor ms | prefill ms | of which tower ms | rest ms |",
        "|---|---|---|---|---|---|",
    ]
    for model, report in models.items():
        if "vgraph" not in report["systems"]:
            continue
        hf, vgraph = report["systems"]["hf"]["levels"], report["systems"]["vgraph"]["levels"]
        for level in hf:
            if "breakdown" not in hf[level] or "breakdown" not in vgraph[level]:  # a report made before the clock
                continue
            cells = [f"{hf[level]['breakdown'][key]} → {vgraph[level]['breakdown'][key]}" for key in BREAKDOWN]
            lines.append(f"| {model} | {level} | {' | '.join(cells)} |")
    return "\n".join(lines)


BREAKDOWN = ("processor", "prefill", "tower", "rest")
"""The parts of a level's ``breakdown``, in the table's order."""


def plot(models: dict[str, Any], path: Path) -> bool:
    """TTFT p50 and p99 against concurrency, stock and vgraph, one panel per model; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, (model, report) in zip(axes[0], models.items()):
        for name, style in (("hf", "tab:gray"), ("vgraph", "tab:blue")):
            if name not in report["systems"]:
                continue
            levels = report["systems"][name]["levels"]
            clients = [int(level) for level in levels]
            for key, line in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--")):
                axis.plot(clients, [levels[level][key] for level in levels], line, color=style, marker="o",
                          label=f"{'stock' if name == 'hf' else 'vgraph'} {key[5:8]}")  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("concurrent streaming clients")
        axis.set_ylabel("time to first token, ms")
        axis.set_title(f"{report['model']}\n{report['device']}", fontsize=9)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        system, clock_path, *rest = argv[1:]
        split = rest.index("--vgraph")
        serve_main(system, clock_path, rest[:split], rest[split + 1 :])
        return {}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-vl", help="qwen2.5-vl, internvl3-1b; paddleocr_vl with --tiny")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU smoke run)")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per level (at least 4 per client)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", help="checkpoint, artifacts and server logs (default: a new temporary directory)")
    parser.add_argument("--json", help="default: benchmarks/results/serve_load_<device>.json (this model's entry)")
    parser.add_argument("--merge", nargs="+", help="only merge these runs' JSON files into --json (table, plot)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = Path(args.json or RESULTS / f"serve_load_{device_tag(args.device)}.json")
    models = json.loads(path.read_text()) if path.exists() else {}
    if args.merge:
        for other in args.merge:
            models.update(json.loads(Path(other).read_text()))
        report = {}
    else:
        def save(report: dict[str, Any]) -> None:
            models[args.model] = report
            path.write_text(json.dumps(models, indent=1))

        report = run(args, save)
        models[args.model] = report
        print(json.dumps({k: v for k, v in report.items() if k != "systems"}, indent=1))
        for name, system in report["systems"].items():
            print(f"{name}: start-up {system['startup_s']} s" + (f"\n{system['buckets']}" if system["buckets"] else ""))
    path.write_text(json.dumps(models, indent=1))
    print(table(models))
    if not plot(models, path.with_suffix(".png")):
        print("no plot: matplotlib is not installed")
    return report


if __name__ == "__main__":
    main()
