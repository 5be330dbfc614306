"""On two CUDA GPUs (NCCL): a toy Qwen2.5-VL tower over ``parallel="auto"``, its sequence-parallel all-to-alls
captured inside CUDA graphs, equal to the stock tower on a mixed stream; after ``close()`` (the graphs holding the
communicator released) ``destroy_process_group`` returns within seconds. NCCL 2.26+ waits, at destroy, for every
graph that captured a collective on the communicator (pytorch#115388): without ``close()`` it never returns. Run
with ``pytest -m gpu``."""

import datetime
import json
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

GRIDS = ([(1, 16, 24)], [(1, 4, 8), (1, 16, 16), (1, 4, 4)], [(1, 8, 8)] * 3, [(4, 8, 8)])
"""One image by rows, a large image by rows beside small ones by items, small ones by items, a video by frames."""


def _rank(rank: int, directory: str) -> None:
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{directory}/init", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    device = torch.device("cuda", rank)
    tower = qwen_tower("qwen2.5-vl", device, torch.float32, **TOY_SIZES["qwen2.5-vl"])
    compiled = compile_vision_tower(
        tower, process_group=dist.group.WORLD, parallel="auto", token_budgets=[64, 256], max_items=3,
        attention_backend="sdpa",
    )
    errors = []
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS):
            generator = torch.Generator().manual_seed(seed)
            rows = sum(t * h * w for t, h, w in grid)
            pixel_values = torch.randn(rows, *compiled.interface.pixel_shape, generator=generator).to(device)
            grid_thw = torch.tensor(grid)
            out = compiled(pixel_values, grid_thw)
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 patch convolution, not TF32
                stock = tower(pixel_values, grid_thw.to(device))
            errors.append(float((out.pooler_output - stock.pooler_output).norm() / stock.pooler_output.norm()))
    (runtime,) = compiled.sequence_graphs.compiled.vgraph.runtimes
    captured = sum(bucket.graph is not None for bucket in runtime.buckets)
    torch.cuda.synchronize()
    compiled.close()
    begin = time.perf_counter()
    dist.destroy_process_group()
    result = {"errors": errors, "captured": captured, "modes": dict(compiled.parallel_calls)}
    result["destroy_s"] = time.perf_counter() - begin
    Path(directory, f"rank{rank}.json").write_text(json.dumps(result))


def test_auto_over_captured_all_to_alls_equals_stock_and_tears_down():
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.start_processes(_rank, args=(directory,), nprocs=2, start_method="spawn")
        results = [json.loads(Path(directory, f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert all(error < 1e-4 for error in result["errors"]), (rank, result)
        assert result["captured"] == 2, (rank, result)  # both buckets' sequence graphs, all-to-alls inside
        assert set(result["modes"]) == {"sequence", "sequence+data", "data"}, (rank, result)
        assert result["destroy_s"] < 5.0, (rank, result)
