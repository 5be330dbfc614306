import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers import trace
from vgraph_compile.config import VGraphConfig
from vgraph_compile.models.packed_vit import PackedViT, pack_images

os.environ["VGRAPH_ARTIFACT_DIR"] = ""  # compiles stay counted as compiles; tests of artifacts name their directory
# One intra-op thread, here and in the child processes the tests start: the tests' tensors are small, so a second
# thread buys little, and on a shared machine its OpenMP spin-waits, while the other thread is descheduled, made the
# suite several times slower. A thread count set by the caller (OMP_NUM_THREADS) is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile(
    "default", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def cold_inductor_cache(tmp_path, monkeypatch):
    """An empty inductor (and Triton) cache directory of the test's own, with torch's in-memory compile caches
    and dynamo cleared: the first compile in the test starts cold, as on a fresh machine. Yields the directory
    (``torch._inductor.runtime.cache_dir_utils.cache_dir()`` reads the variable at every use)."""
    from torch._inductor.utils import clear_caches

    directory = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(directory / "triton"))
    clear_caches()
    torch._dynamo.reset()
    yield directory
    clear_caches()
    torch._dynamo.reset()


FORK_SERVER = """
import json, os, sys, tempfile, traceback
import torch, torch._dynamo, torch._inductor.compile_fx, vgraph_compile  # imported once, before any job
for line in sys.stdin:
    job = json.loads(line)
    read, write = os.pipe()
    with tempfile.TemporaryFile() as stderr:
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(stderr.fileno(), 2)
            sys.argv = ["-c", *job["argv"]]
            try:
                exec(compile(job["script"], "<job>", "exec"), {"__name__": "__main__"})
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(write)
        with os.fdopen(read) as out:
            stdout = out.read()
        returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        stderr.seek(0)
        report = {"returncode": returncode, "stdout": stdout, "stderr": stderr.read().decode(errors="replace")}
    print(json.dumps(report), flush=True)
"""


@pytest.fixture(scope="session")
def new_process():
    """Runs ``script`` with ``argv`` in a new process: a fork of one server process that imported torch and
    vgraph_compile and did nothing else (no trace, no compile), so the tests' second processes pay the imports
    once. Returns a ``subprocess.CompletedProcess`` (its stdout and stderr)."""
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen(
        [sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
        env=environment,
    )  # fmt: skip

    def run(script: str, *argv: str) -> subprocess.CompletedProcess:
        server.stdin.write(json.dumps({"script": script, "argv": list(argv)}) + "\n")
        server.stdin.flush()
        report = json.loads(server.stdout.readline())
        return subprocess.CompletedProcess(argv, report["returncode"], report["stdout"], report["stderr"])

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


_REPORT: list[str] = []


def report(line: str) -> None:
    """Add a line to the report printed at the end of the test run (e.g. the tightness of the bounds)."""
    _REPORT.append(line)


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("vgraph report")
        for line in _REPORT:
            terminalreporter.write_line(line)

@pytest.fixture
def tiny():
    """A one-block PackedViT traced on two images, with budgets (16, 64), 4 segments, the SDPA backend."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    inputs = pack_images([5, 7], 12)
    config = VGraphConfig(token_budgets=(16, 64), max_segments=4, attention_backend="sdpa")
    gm, ctx = trace(model, *inputs, config=config)
    return model, gm, ctx
