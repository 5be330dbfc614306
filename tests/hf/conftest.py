import pytest
import torch

from vgraph_compile.models.qwen_towers import TOY_SIZES

transformers = pytest.importorskip("transformers", minversion="5.23")

__all__ = ["TOY_SIZES"]


@pytest.fixture(scope="module")
def towers():
    from vgraph_compile.models.qwen_towers import qwen_tower

    return {name: qwen_tower(name, device="cpu", dtype=torch.float32, **size) for name, size in TOY_SIZES.items()}


def pytest_collection_finish(session):
    """Start the gloo groups' server as soon as a test that needs a group is collected (``gloo_group.py``)."""
    if any("gloo_group" in getattr(item, "fixturenames", ()) for item in session.items):
        from tests.hf.gloo_group import start_server

        start_server()


@pytest.fixture(scope="session", params=[2, 3])
def gloo_group(request, tmp_path_factory):
    """(ranks, each rank's {check: "ok" or traceback}) from one group of gloo processes that ran the
    multi-process checks of tests/hf (``tests/hf/gloo_group.py``)."""
    from tests.hf.gloo_group import spawn

    return spawn(request.param, tmp_path_factory.mktemp(f"gloo{request.param}"))
