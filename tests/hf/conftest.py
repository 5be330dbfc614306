import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from vgraph_compile.sample_models.qwen_towers import TOY_SIZES

transformers = pytest.importorskip("transformers", minversion="5.23")

__all__ = ["TOY_SIZES"]


@pytest.fixture(scope="module")
def towers():
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    return {name: qwen_tower(name, device="cpu", dtype=torch.float32, **size) for name, size in TOY_SIZES.items()}


@functools.cache
def _run_directory(config) -> Path:
    """A directory of this test run, the same in each of its test processes: pytest-xdist gives each worker a
    base temporary directory inside the run's own (which pytest removes a few runs later)."""
    if hasattr(config, "workerinput"):
        return Path(config.option.basetemp).parent / "gloo-groups"
    return Path(tempfile.mkdtemp(prefix="gloo-groups-"))


def pytest_collection_finish(session):
    """Start the gloo groups the collected tests read, in the background (``gloo_group.py``)."""
    sizes = {item.callspec.params["gloo_group"] for item in session.items if "gloo_group" in item.fixturenames}
    if sizes and not session.config.option.collectonly:
        from tests.hf.gloo_group import start

        start(sorted(sizes), _run_directory(session.config))


def pytest_sessionfinish(session):
    """This process's groups end before it does: other test processes may still read them. A run without workers
    removes its own directory (pytest-xdist's is inside the run's base temp, which pytest rotates)."""
    from tests.hf.gloo_group import finish

    finish()
    if not hasattr(session.config, "workerinput") and _run_directory.cache_info().currsize:
        shutil.rmtree(_run_directory(session.config), ignore_errors=True)


@pytest.fixture(scope="session", params=[2, 3])
def gloo_group(request):
    """(ranks, each rank's {check: "ok" or traceback}) from one group of gloo processes that ran the
    multi-process checks of tests/hf (``tests/hf/gloo_group.py``)."""
    from tests.hf.gloo_group import results

    return results(request.param, _run_directory(request.config))
