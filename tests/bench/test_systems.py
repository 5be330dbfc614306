"""The benchmark's systems: every system but the per-case oracle has a builder, and the systems without a CPU
form are systems. (Each system built and measured on a toy tower: ``test_cli.py``.)"""

import argparse

import torch

from vgraph_compile.bench.systems import NEEDS_CUDA, SYSTEMS, factories
from vgraph_compile.bench.workload import Workload


def _workload(tower) -> Workload:
    return Workload(tower, requests=[], cases={}, device=torch.device("cpu"), dtype=torch.float32)


def test_every_system_but_the_oracle_has_a_builder(bench_tower):
    args = argparse.Namespace(compile_backend="eager", vgraph_option={})
    assert set(factories(_workload(bench_tower), args)) == set(SYSTEMS) - {"exact_shape_oracle"}
    assert set(NEEDS_CUDA) <= set(SYSTEMS)
