"""Host time of one ``torch.cuda.CUDAGraph.replay()`` (call to return, GPU idle before each), against the graph's
kernel count, each kernel's duration, memset/memcpy nodes, an explicit upload, and the driver's launch queue size.

Each graph is ``kernels`` in-place multiplies of one fp32 tensor of ``elements`` (a chain: each kernel waits for
the one before), so its kernel count is fixed while the size sets each kernel's duration. Cases:
- ``chain``: kernel counts x sizes;
- ``nodes``: the same count with a fifth of the kernels replaced by ``copy_`` and ``zero_`` (memcpy/memset nodes);
- ``upload``: the first replay after capture, with and without ``cuGraphUpload`` (driver API, through ctypes)
  before it, and the steady replays after;
- ``after_wait``: a fixed host workload with no device work (100 ``narrow`` calls on a CUDA tensor), timed right
  after ``synchronize()`` returned from device work of ``wait_ms``: whether the host runs slower after a long
  wait (a core that slept), as a call timed with the GPU idle before it would.
Each case runs in a child process per launch-queue setting (``CUDA_SCALE_LAUNCH_QUEUES`` unset, then ``4x``: the
driver reads it when it creates the context).

    python benchmarks/graph_replay.py --json PATH
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from vgraph_compile.bench.report import write_report
from vgraph_compile.compile.buckets import upload

KERNELS = (100, 400, 1000)
ELEMENTS = (2**12, 2**20, 2**22, 2**24)
QUEUES = (None, "4x")


def _host_us(fn, calls: int = 30) -> float:
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(samples), 1)


def _device_ms(fn, calls: int = 5) -> float:
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def _capture(kernels: int, elements: int, memory_nodes: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.rand(elements, device="cuda") + 0.5
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(kernels):
            if memory_nodes and index % 10 == 0:
                y.copy_(x)
            elif memory_nodes and index % 10 == 5:
                y.zero_()
            else:
                x.mul_(1.0)
    return graph, x


def _child() -> dict:
    torch.cuda.init()
    torch.ones(1, device="cuda")
    rows = []
    for kernels in KERNELS:
        for elements in ELEMENTS:
            graph, _ = _capture(kernels, elements)
            graph.replay()
            rows.append(
                {
                    "case": "chain",
                    "kernels": kernels,
                    "elements": elements,
                    "device_ms": _device_ms(graph.replay),
                    "host_us": _host_us(graph.replay),
                }
            )
            del graph
    for memory_nodes in (False, True):
        for elements in (2**12, 2**24):
            graph, _ = _capture(400, elements, memory_nodes)
            graph.replay()
            rows.append(
                {
                    "case": "nodes",
                    "memory_nodes": memory_nodes,
                    "kernels": 400,
                    "elements": elements,
                    "device_ms": _device_ms(graph.replay),
                    "host_us": _host_us(graph.replay),
                }
            )
    for uploaded in (False, True):
        for elements in (2**12, 2**24):
            graph, _ = _capture(400, elements)
            torch.cuda.synchronize()
            if uploaded:
                if not upload(graph):
                    raise RuntimeError("cuGraphUpload did not take the graph")
                torch.cuda.synchronize()
            first = _host_us(graph.replay, 1)
            rows.append(
                {
                    "case": "upload",
                    "uploaded": uploaded,
                    "kernels": 400,
                    "elements": elements,
                    "first_host_us": first,
                    "host_us": _host_us(graph.replay),
                }
            )
    x = torch.zeros(16, device="cuda")

    def host_work() -> None:
        for _ in range(100):
            x.narrow(0, 0, 8)

    for kernels, elements in ((1, 2**12), (400, 2**20), (1000, 2**24)):
        graph, _ = _capture(kernels, elements)
        graph.replay()
        samples = []
        for _ in range(30):
            graph.replay()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            host_work()
            samples.append((time.perf_counter() - begin) * 1e6)
        rows.append(
            {
                "case": "after_wait",
                "wait_ms": _device_ms(graph.replay),
                "host_work_us": round(statistics.median(samples), 1),
            }
        )
    return {"queue": os.environ.get("CUDA_SCALE_LAUNCH_QUEUES"), "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child()))
        return {}
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "runs": []}
    for queue in QUEUES:
        environment = dict(os.environ)
        environment.pop("CUDA_SCALE_LAUNCH_QUEUES", None)
        if queue is not None:
            environment["CUDA_SCALE_LAUNCH_QUEUES"] = queue
        child = subprocess.run(
            [sys.executable, __file__, "--child"], capture_output=True, text=True, env=environment
        )
        if child.returncode != 0:
            raise SystemExit(child.stderr[-4000:])
        run = json.loads(child.stdout.strip().splitlines()[-1])
        report["runs"].append(run)
        for row in run["rows"]:
            print(f"queue={queue} " + " ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
