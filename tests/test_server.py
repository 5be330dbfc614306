"""``vgraph serve`` as a user runs it: ``vgraph precompile`` of a saved model directory, then the real server
(transformers' own, over HTTP on localhost) started from it, next to the stock ``transformers serve`` of the same
directory, both driven by the ``openai`` client with concurrent streaming requests."""

import base64
import concurrent.futures
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vgraph_compile.cli import main  # noqa: E402
from vgraph_compile.sample_models.checkpoints import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)

OPTIONS = ["--budgets", "128", "512", "--max-items", "4"]
OPTIONS += ["--options", '{"compiler": "eager", "attention_backend": "sdpa"}']
STOCK = "import typer; from transformers.cli.serve import Serve; typer.run(Serve)"
REQUESTS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny PaddleOCR-VL (a packed tower; its processor needs no torchvision) saved as a checkpoint."""
    return save_checkpoint("paddleocr_vl", tmp_path_factory.mktemp("paddleocr_vl"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


class Server:
    """A server process on a free localhost port, its output in a file."""

    def __init__(self, argv: list[str], log_path) -> None:
        self.port = _free_port()
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
        with open(log_path, "w") as log:
            argv = [*argv, "--device", "cpu", "--port", str(self.port)]
            self.process = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            try:
                with urllib.request.urlopen(f"http://localhost:{self.port}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"no server on port {self.port} after {timeout} s:\n{self.log()}")

    def stop(self) -> str:
        """Stop as Ctrl-C does (uvicorn shuts down, the models are unloaded); returns the output."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.log()

    def log(self) -> str:
        return self.log_path.read_text()


def _image_url(seed: int, height: int, width: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _ask(port: int, model: str, index: int) -> str:
    """One streamed chat completion with its own image (its own size) and the same text as every other request:
    the answer's text (answers that differ differ by their image)."""
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0)
    content = [
        {"type": "image_url", "image_url": {"url": _image_url(index, 40 + 24 * index, 96 - 12 * index)}},
        {"type": "text", "text": "t10 t7"},
    ]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True, max_tokens=4, temperature=0
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _bucket_hits(log: str) -> int:
    """The hits of every bucket in the tables the server logged at shutdown."""
    rows = re.findall(r"^\s*\d+\s+\[[\d, ]*\]\s+\[[\d, ]*\]\s+(\d+)\s+[\d.]+%$", log, re.M)
    return sum(map(int, rows))


def test_precompiled_server_answers_concurrent_streams_as_the_stock_server(model_dir, tmp_path, capsys):
    """vgraph precompile saves the tower's plans; vgraph serve with them starts with no trace and no compile. Four
    requests with different images in flight at once, to it and to the stock transformers serve of the same
    directory: every answer (greedy, streamed) is the stock server's for the same request, the answers differ from
    request to request though their text is the same (so by their images: an image reaching another request would
    show), and the tower's buckets served the warm-up's two calls and one call per request."""
    name, artifacts = str(model_dir), str(tmp_path / "artifacts")
    stock = Server(["-c", STOCK, name], tmp_path / "stock.log")
    vgraph = None
    try:
        main(["precompile", name, *OPTIONS, "--artifact-dir", artifacts, "--device", "cpu"])
        assert f"{name}: saved (build plans" in capsys.readouterr().out
        serve = ["-m", "vgraph_compile.cli", "serve", name, *OPTIONS, "--artifact-dir", artifacts]
        vgraph = Server(serve, tmp_path / "vgraph.log")
        vgraph.wait_ready()
        stock.wait_ready()
        assert "vgraph serve: " + name + " ready, start-up" in vgraph.log()
        # One request first, alone: the openai client builds its pydantic response models on first use, and
        # threads building one at once can read a half-built model.
        alone = _ask(stock.port, name, 0)
        with concurrent.futures.ThreadPoolExecutor(2 * REQUESTS) as pool:
            served = [pool.submit(_ask, vgraph.port, name, index) for index in range(REQUESTS)]
            stocked = [pool.submit(_ask, stock.port, name, index) for index in range(REQUESTS)]
            answers = [future.result(timeout=120) for future in served]
            expected = [future.result(timeout=120) for future in stocked]
    finally:
        stock.stop()
        log = vgraph.stop() if vgraph is not None else ""
    assert answers == expected and expected[0] == alone
    assert len(set(answers)) > 1, answers
    assert "served by vgraph" in log and "served stock" not in log
    assert "serving from the build plan" in log and "discovered" not in log  # no trace
    assert _bucket_hits(log) == 2 + REQUESTS, log


def test_a_model_vgraph_cannot_serve_is_served_stock_with_one_warning(caplog):
    """A model with no vision tower (a text model) is left as it was, with one warning naming why."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vgraph_compile.hf.server import serve_model

    config = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with caplog.at_level("WARNING", logger="vgraph_compile"):
        assert not serve_model(model, None, {})
    modules = {type(module).__name__ for module in model.modules()}
    assert not any(name.startswith("Compiled") for name in modules)
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "Qwen2ForCausalLM is served stock: compile_vlm found no vision tower" in warnings[0]


def test_a_transformers_without_the_hook_point_is_refused_naming_its_version(monkeypatch):
    """A transformers whose ModelManager hands out no models through load_model_and_processor: vgraph serve stops
    with a message naming the installed version and what is missing."""
    import transformers
    from transformers.cli.serving import model_manager

    from vgraph_compile.hf.server import hook_point

    monkeypatch.setattr(model_manager, "ModelManager", type("ModelManager", (), {}))
    with pytest.raises(SystemExit, match=f"transformers {transformers.__version__} changed the hook point .*"
                       "no ModelManager.load_model_and_processor"):  # fmt: skip
        hook_point()
