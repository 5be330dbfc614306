"""Fixtures and settings for every test. Imports nothing heavy at module level: pytest-xdist's controller process
loads this file before it starts the workers, and only the workers collect and run tests (each imports torch and
vgraph_compile with its first test module)."""

import multiprocessing
import os
import subprocess
import sys
import traceback

import pytest
from hypothesis import HealthCheck, settings

os.environ["VGRAPH_ARTIFACT_DIR"] = ""  # compiles stay counted as compiles; tests of artifacts name their directory
# One intra-op thread, here and in the child processes the tests start (torch reads the variable when it is first
# imported, after this file): the tests' tensors are small, so a second thread buys little, and on a shared machine
# its OpenMP spin-waits, while the other thread is descheduled, made the suite several times slower. A thread count
# set by the caller (OMP_NUM_THREADS) is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The default (CI) profile: 15 derandomized examples per test (each compiled test's examples are calls of one
# compile, so the first few find what most of the rest would); the thorough profile draws 300 random ones.
settings.register_profile(
    "default", deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="module")
def cold_inductor_cache(tmp_path_factory):
    """An empty inductor (and Triton) cache directory of the module's own, with torch's in-memory compile caches
    and dynamo cleared: the module's first compile starts cold, as on a fresh machine; its later tests compile
    graphs new to that cache (FX graph cache misses, each counted) and reuse only C++ kernels of identical source.
    One cold cache per module, not per test. Yields the directory (``torch._inductor.runtime.cache_dir_utils.
    cache_dir()`` reads the variable at every use)."""
    import torch
    from torch._inductor.utils import clear_caches

    directory = tmp_path_factory.mktemp("cold") / "inductor"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
        monkeypatch.setenv("TRITON_CACHE_DIR", str(directory / "triton"))
        clear_caches()
        torch._dynamo.reset()
        yield directory
        clear_caches()
        torch._dynamo.reset()


def _run_script(script: str, argv: list[str], stdout: str, stderr: str) -> None:
    """A ``new_process`` job, in the forked child: ``script`` as ``__main__`` with ``argv``, its output to files."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-c", *argv]
    try:
        exec(compile(script, "<job>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@pytest.fixture(scope="session")
def new_process(tmp_path_factory):
    """Runs ``script`` with ``argv`` in a new process: a fork of the standard library's forkserver, which imported
    torch and vgraph_compile and did nothing else (no trace, no compile), so the tests' second processes pay the
    imports once. Returns a ``subprocess.CompletedProcess`` (its stdout and stderr)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo", "torch._inductor.compile_fx", "vgraph_compile"])
    directory = tmp_path_factory.mktemp("new_process")

    def run(script: str, *argv: str) -> subprocess.CompletedProcess:
        stdout, stderr = directory / "stdout", directory / "stderr"
        child = context.Process(target=_run_script, args=(script, list(argv), str(stdout), str(stderr)))
        child.start()
        child.join()
        return subprocess.CompletedProcess(argv, child.exitcode, stdout.read_text(), stderr.read_text())

    return run


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    """Skip the GPU tests without a GPU, and order the modules as pytest-xdist hands them out (one module per
    worker at a time, ``--dist loadfile --no-loadscope-reorder``): ``heavy`` modules first, then by test count, the
    largest first, so no worker is left with a long module at the end while the other idles."""
    import torch

    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules.values(), key=lambda tests: (tests[0].get_closest_marker("heavy") is None, -len(tests)))
    items[:] = [item for tests in order for item in tests]


_REPORT: list[str] = []


def report(line: str) -> None:
    """Add a line to the report printed at the end of the test run (e.g. the tightness of the bounds)."""
    _REPORT.append(line)


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its report lines to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["vgraph_report"] = list(_REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _REPORT.extend(getattr(node, "workeroutput", {}).get("vgraph_report", ()))


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("vgraph report")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture
def tiny():
    """A one-block PackedViT traced on two images, with budgets (16, 64), 4 segments, the SDPA backend."""
    import torch

    from tests.helpers import trace
    from vgraph_compile.config import VGraphConfig
    from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    inputs = pack_images([5, 7], 12)
    config = VGraphConfig(token_budgets=(16, 64), max_segments=4, attention_backend="sdpa")
    gm, ctx = trace(model, *inputs, config=config)
    return model, gm, ctx
