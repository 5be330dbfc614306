import pytest
import torch

from vgraph_compile.sample_models.qwen_towers import TOY_SIZES

transformers = pytest.importorskip("transformers", minversion="5.23")

__all__ = ["TOY_SIZES"]


@pytest.fixture(scope="module")
def towers():
    from vgraph_compile.sample_models.qwen_towers import qwen_tower

    return {name: qwen_tower(name, device="cpu", dtype=torch.float32, **size) for name, size in TOY_SIZES.items()}


def pytest_collection_finish(session):
    """Start the gloo groups the collected tests read, in the background (``gloo_group.py``)."""
    sizes = {item.callspec.params["gloo_group"] for item in session.items if "gloo_group" in item.fixturenames}
    if sizes:
        from tests.hf.gloo_group import start

        start(sorted(sizes))


@pytest.fixture(scope="session", params=[2, 3])
def gloo_group(request):
    """(ranks, each rank's {check: "ok" or traceback}) from one group of gloo processes that ran the
    multi-process checks of tests/hf (``tests/hf/gloo_group.py``)."""
    from tests.hf.gloo_group import results

    return results(request.param)
