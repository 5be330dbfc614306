"""Groups of gloo processes for the multi-process tests of ``tests/hf`` (data- and sequence-parallel encoding).

One group per size is started for the whole session (the ``gloo_group`` fixture) and runs the ``CHECKS[ranks]``
of every module in ``CHECK_MODULES`` in turn; the checks share the compiled toy towers and the whole tiny VLM of
their process (``compiled``, ``tiny_vlm``), each switching the mode it tests (``parallel``). Each rank writes what
each check gave (``ok`` or the traceback) to a file, and the tests read them (``assert_passed``).

The ranks are forked from one server process that imported torch, transformers' Qwen modules and the checks once
(``PRELOAD``): a fresh single-threaded interpreter, so forking it is safe, and no rank imports them again. When the
tests are collected, the groups they need start running one after another in a background thread (``start``):
their processes share nothing with the test process, and the tests of other modules run meanwhile; a test reading
a group waits for it (``results``). Each group runs once per test run, in whichever of its test processes
(pytest-xdist's workers, which each collect every test) claims it first; the others read its written results.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import functools
import importlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from vgraph_compile.sample_models.qwen_towers import REAL_SIZES

CHECK_MODULES = (
    "tests.hf.parallel.test_data_parallel",
    "tests.hf.parallel.test_sequence_parallel",
    "tests.hf.parallel.test_rank_agreement",
    "tests.hf.parallel.test_parallel_error",
)
PRELOAD = (
    __name__,
    *CHECK_MODULES,
    "vgraph_compile.hf",
    "vgraph_compile.sample_models.qwen_vlms",
    *(module for module, *_ in REAL_SIZES.values()),
    "functorch.compile",
)
"""What the ranks' server imports before it forks them: the checks, the modules their models are built from, and
dynamo's compile stack (imported at a first trace)."""

OPTIONS = dict(token_budgets=[64, 256], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa")
"""Small buckets: over 3 items, 6 frames or 256 patches split a rank's share (data parallel), or a rank's slice
over 256 patches runs its trace eagerly (sequence parallel, on every rank alike)."""


_TOWERS: list = []
"""Every tower compiled over a group in this process (closed before its group is destroyed)."""


@functools.cache
def compiled(name: str, group, dtype: torch.dtype = torch.float32):
    """The toy tower ``name`` (``TOY_SIZES``) in ``dtype`` compiled over ``group``, once per process."""
    from vgraph_compile.hf import compile_vision_tower
    from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

    tower = qwen_tower(name, "cpu", dtype, **TOY_SIZES[name])
    _TOWERS.append(compile_vision_tower(tower, process_group=group, **OPTIONS))
    return _TOWERS[-1]


@contextlib.contextmanager
def parallel(tower, mode: str) -> Iterator[collections.Counter]:
    """``tower`` encoding in ``mode`` inside the block; yields the calls counted per mode in it."""
    before, tower.parallel = tower.parallel, mode
    calls, tower.parallel_calls = tower.parallel_calls, collections.Counter()
    try:
        yield tower.parallel_calls
    finally:
        tower.parallel, tower.parallel_calls = before, calls + tower.parallel_calls


def inputs(tower, grid, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows for ``grid`` (t, h, w patches per item), in the tower's dtype, and the grid as
    ``grid_thw``."""
    (width,) = tower.interface.pixel_shape
    patches = sum(t * h * w for t, h, w in grid)
    generator = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(patches, width, generator=generator).to(tower.parameter.dtype)
    return pixel_values, torch.tensor(grid, dtype=torch.int64).view(-1, 3)


@functools.cache
def tiny_vlm(group):
    """A whole tiny Qwen3-VL (deepstack features feed the language model) with ``compile_vlm`` over ``group``, two
    prompts with three photos and a video clip, and the stock model's logits and greedy tokens on them:
    ``(model, inputs, logits, tokens)``."""
    from vgraph_compile.hf import compile_vlm
    from vgraph_compile.sample_models.qwen_vlms import (
        Item,
        Request,
        image_processor,
        model_inputs,
        photos,
        qwen_vlm,
        video_clip,
    )

    model = qwen_vlm("qwen3-vl")
    photo = photos()
    clip = video_clip(photo["astronaut"], frames=4, size=(112, 112), step=16)
    requests = [
        Request((Item("image", photo["coffee"]), Item("video", clip)), (7, 3, 2), seed=1),
        Request((Item("image", photo["chelsea"], (150, 220)), Item("image", photo["rocket"])), (4, 2, 9), seed=2),
    ]
    model_in = model_inputs(model, requests, image_processor(model.config, max_patches=128))
    with torch.no_grad():
        logits = model(**model_in).logits
        tokens = model.generate(**model_in, max_new_tokens=4, do_sample=False)
    compile_vlm(model, process_group=group, **{**OPTIONS, "max_items": 4})
    _TOWERS.append(model.model.visual)
    return model, model_in, logits, tokens


def vlm_equals_stock(group) -> collections.Counter:
    """The tiny VLM's logits and greedy tokens through its compiled tower equal the stock model's; returns the
    tower's calls per mode."""
    model, model_in, logits, tokens = tiny_vlm(group)
    tower = model.model.visual
    stock_calls = tower.stock_calls
    with torch.no_grad():
        mine = model(**model_in).logits
        generated = model.generate(**model_in, max_new_tokens=4, do_sample=False)
    assert tower.stock_calls == stock_calls
    torch.testing.assert_close(mine, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())
    assert torch.equal(generated, tokens)
    return tower.parallel_calls


def single(tower, pixel_values, grid_thw):
    """The single-process call of ``tower``: the same graphs, no collective."""
    group, tower.process_group = tower.process_group, None
    try:
        return tower(pixel_values, grid_thw)
    finally:
        tower.process_group = group


DESTROY_SECONDS = "destroy_process_group seconds"
"""The key under which each rank records how long its ``destroy_process_group`` took."""


def _check_name(check: Callable) -> str:
    return f"{check.__module__}.{check.__name__}"


def _rank(rank: int, ranks: int, directory: str) -> None:
    """Run the checks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (before each collective, the ranks compare what they
    are about to issue, and a mismatch raises), close the compiled towers and time ``destroy_process_group``."""
    torch.set_num_threads(1)
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # the variable is read when torch.distributed is imported
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/init",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=60),
    )
    results = {}
    try:
        for module in CHECK_MODULES:
            for check in importlib.import_module(module).CHECKS.get(ranks, []):
                try:
                    check(dist.group.WORLD)
                    results[_check_name(check)] = "ok"
                except Exception:
                    results[_check_name(check)] = traceback.format_exc()
    finally:
        for tower in _TOWERS:
            tower.close()
        begin = time.perf_counter()
        dist.destroy_process_group()
        results[DESTROY_SECONDS] = time.perf_counter() - begin
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)


def start_server() -> None:
    """Start the server the ranks are forked from, if it is not running: it imports ``PRELOAD`` in the background."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()


def spawn(ranks: int) -> tuple[int, list[dict[str, str]]]:
    """Run every module's checks in one group of ``ranks`` gloo processes: (ranks, each rank's results)."""
    start_server()
    with tempfile.TemporaryDirectory(prefix=f"gloo{ranks}-") as directory:
        torch.multiprocessing.start_processes(_rank, args=(ranks, directory), nprocs=ranks, start_method="forkserver")
        return ranks, [json.loads(Path(directory, f"rank{rank}.json").read_text()) for rank in range(ranks)]


_GROUPS: dict[int, concurrent.futures.Future] = {}
"""Each group size this process runs, started by ``start``."""

WAIT_SECONDS = 900
"""How long a test waits for a group another test process runs."""


def _record(directory: Path, ranks: int) -> Path:
    return directory / f"group{ranks}.json"


def _run_and_record(ranks: int, directory: Path) -> tuple[int, list[dict[str, str]]]:
    """``spawn(ranks)``, its results (or the error that ended it) written where every test process reads them."""
    try:
        group = spawn(ranks)
    except BaseException:
        record = {"error": traceback.format_exc()}
        raise
    else:
        record = {"results": group[1]}
        return group
    finally:
        partial = _record(directory, ranks).with_suffix(".partial")
        partial.write_text(json.dumps(record))
        partial.rename(_record(directory, ranks))


def start(sizes, directory: Path) -> None:
    """Run the groups of ``sizes`` that no test process of this run started yet, one after another, in a background
    thread. ``directory`` is the run's, shared by its test processes (pytest-xdist's workers): a lock file per size
    there makes one process run each group, once, and its results are written there for every process."""
    directory.mkdir(parents=True, exist_ok=True)
    mine = []
    for ranks in sizes:
        if ranks in _GROUPS:
            continue
        try:
            lock = os.open(directory / f"group{ranks}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another test process of this run runs it
            continue
        os.write(lock, str(os.getpid()).encode())
        os.close(lock)
        mine.append(ranks)
    if mine:
        runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gloo-groups")
        _GROUPS.update({ranks: runner.submit(_run_and_record, ranks, directory) for ranks in mine})
        runner.shutdown(wait=False)


def results(ranks: int, directory: Path) -> tuple[int, list[dict[str, str]]]:
    """The group of ``ranks``: (ranks, each rank's results), once its run (started here if no test process of this
    run started it) ends."""
    start([ranks], directory)
    if ranks in _GROUPS:
        return _GROUPS[ranks].result()
    deadline = time.monotonic() + WAIT_SECONDS
    while not _record(directory, ranks).exists():
        assert time.monotonic() < deadline, f"the group of {ranks} run by another test process wrote no results"
        assert _alive(directory / f"group{ranks}.lock"), f"the test process running the group of {ranks} ended first"
        time.sleep(0.5)
    record = json.loads(_record(directory, ranks).read_text())
    assert "error" not in record, f"the group of {ranks} failed in another test process:\n{record.get('error')}"
    return ranks, record["results"]


def _alive(lock: Path) -> bool:
    """Whether the test process that wrote its pid in ``lock`` still runs (True while the pid is not written yet)."""
    text = lock.read_text()
    if not text:
        return True
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return _record(lock.parent, int(lock.stem.removeprefix("group"))).exists()  # it may have just written it
    return True


def finish() -> None:
    """Wait for the groups this process runs (the other test processes read their results)."""
    concurrent.futures.wait(list(_GROUPS.values()))


def assert_passed(group: tuple[int, list[dict[str, str]]], check: Callable, checks: dict[int, list]) -> None:
    """``check`` passed on every rank of the group (skipped where its module does not run it at that size)."""
    ranks, results = group
    if check not in checks.get(ranks, []):
        pytest.skip(f"not run in the group of {ranks}")
    for rank, result in enumerate(results):
        assert result[_check_name(check)] == "ok", f"rank {rank} of {ranks}:\n{result[_check_name(check)]}"


def passed_on_every_rank(checks: dict[int, list], apart: tuple[Callable, ...] = ()) -> Callable:
    """One test per check of ``checks`` (every group size's, but those the module tests ``apart``): the check passed
    on every rank of each group that runs it (``assert_passed``), named after the check."""
    every = [check for check in dict.fromkeys(c for group in checks.values() for c in group) if check not in apart]

    @pytest.mark.parametrize("check", every, ids=lambda check: check.__name__.lstrip("_"))
    def test_passed_on_every_rank(gloo_group, check):
        assert_passed(gloo_group, check, checks)

    return test_passed_on_every_rank
