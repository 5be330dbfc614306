"""``benchmarks/startup.py --interface-only``: a process's interface phase, on a tower built on the meta device."""

import torch

from tests.helpers import benchmark_script
from vgraph_compile.sample_models.qwen_towers import TOY_SIZES


def test_interface_only_learns_then_loads_from_the_run_directory(tmp_path):
    """The first start probes (three forwards of the shrunk tower) and saves; the next loads, with no probe. The
    released-size tower is built on the meta device, and the process's default device is the CPU again after."""
    startup = benchmark_script("startup")
    barrier = tmp_path / "barrier_cold"
    barrier.mkdir()
    cold = startup.interface_start("qwen2.5-vl", TOY_SIZES["qwen2.5-vl"], (str(barrier), 0, 1))
    warm = startup.interface_start("qwen2.5-vl", TOY_SIZES["qwen2.5-vl"], (str(barrier), 0, 1))
    assert (cold["probe_forwards"], cold["interfaces_loaded"]) == (3, 0), cold
    assert (warm["probe_forwards"], warm["interfaces_loaded"]) == (0, 1), warm
    assert list((tmp_path / "interfaces").iterdir()), "nothing saved in the run's directory"
    assert torch.get_default_device() == torch.device("cpu")
