"""Time to first token under concurrent load, over HTTP: transformers' own OpenAI-compatible server (``transformers
serve``) stock, then ``vgraph serve`` (started from ``vgraph precompile``'s plans), on the same local checkpoint.

Model: Qwen2.5-VL-7B or InternVL3-1B at released sizes (random weights, bf16), saved with its processor by
``vgraph_compile.sample_models.checkpoints``; ``--tiny``: a tiny one in float32 (PaddleOCR-VL on a CPU without
torchvision). Requests: the real-photo mix of ``benchmarks/ttft.py`` (1-4 of scikit-image's sample photos resized to
varied sides, 20-300 text tokens; no videos), sent as JPEG data URLs and streamed, greedy, ``--new-tokens`` each,
through the ``openai`` client by 1, 4 and 16 concurrent clients; the server's own processor turns them into pixels.
Per system and concurrency: TTFT p50/p99 (request sent to first content chunk), requests per second, and the
tower's share (its time, synchronized at entry and exit, over the level's wall time); per system the start-up
(process start to ``/health`` answering; vgraph: and the precompile). Both servers get the same requests: the
answers (their token words) are compared request by request.

The server processes run this file with ``--serve``: transformers' ``Serve`` with ``ModelManager`` (stock) or
``vgraph_compile.hf.server.manager_class`` (vgraph), each extended with the tower clock only.

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
import io
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
class TowerClock:
    """Forward hooks on a vision tower: its total wall time (the device synchronized at entry and exit) and calls,
    rewritten to a JSON file after every call."""

    def __init__(self, tower: torch.nn.Module, path: str) -> None:
        self.path, self.total_ms, self.calls, self.start = path, 0.0, 0, 0.0
        self.cuda = next(tower.parameters()).is_cuda
        tower.register_forward_pre_hook(self._enter)
        tower.register_forward_hook(self._exit)
        self._write()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _enter(self, *_: Any) -> None:
        self._sync()
        self.start = time.perf_counter()

    def _exit(self, *_: Any) -> None:
        self._sync()
        self.total_ms += 1e3 * (time.perf_counter() - self.start)
        self.calls += 1
        self._write()

    def _write(self) -> None:
        Path(self.path).write_text(json.dumps({"tower_ms": self.total_ms, "calls": self.calls}))


def clocked(manager: type, path: str) -> type:
    """``manager`` whose models' towers carry a ``TowerClock`` writing to ``path`` (installed once, after the
    manager's own loading: after vgraph's warm-up)."""
    from vgraph_compile.hf.vlm import find_vision_tower

    class ClockedManager(manager):
        def load_model_and_processor(self, *args: Any, **kwargs: Any):
            model, processor = super().load_model_and_processor(*args, **kwargs)
            if not hasattr(model, "_tower_clock"):
                owner, attribute = find_vision_tower(model)
                model._tower_clock = TowerClock(getattr(owner, attribute), path)
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
    requests per second and the tower's share of the wall time."""
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
        "tower_share": round((after["tower_ms"] - before["tower_ms"]) / (1e3 * wall), 3),
        "tower_calls": after["calls"] - before["calls"],
        "ttft_ms": [round(value["ttft_ms"], 1) for value in records],
        "answers": [record["answer"] for record in records],
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
    try:
        for content in requests[:2]:  # the stock model's first calls (kernel choices, allocator) are not measured
            stream(server.port, model_dir, content, args.new_tokens)
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
    return "\n".join(lines)


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
