"""``vgraph-bench``: a Qwen vision tower under every runtime a user would consider, same work, one process.

Systems:
- ``hf_eager_sdpa``: the stock tower; ``eager_varlen``: the stock tower with vgraph's attention op, no graphs;
- ``torch_compile_routed``: ``torch.compile(dynamic=True)`` (inductor, default mode) of the tower with vgraph's
  attention routing and the same host-side grid metadata the vgraph tower uses: the best plain torch.compile;
- ``torch_compile_dynamic`` and ``torch_compile_reduce_overhead``: torch.compile of the stock tower, reported as
  they end (both fail or time out on the real towers);
- ``exact_shape_oracle``: independent of vgraph's runtime. Per fixed case, ``torch.compile(dynamic=False)`` of
  the routed tower for exactly that shape, captured in one ``torch.cuda.CUDAGraph``, with the same per-call host
  work (metadata lookup, fill, replay, copy out);
- ``vgraph``: ``compile_vision_tower`` with the library's defaults; ``vgraph_conservative``: window segments
  sized by the token budget.

Per system: warm-up (build and first call), latencies of the seeded requests, fixed cases, host time per call
(``host_ms_per_call_p50``: call to return with the GPU idle before it), dynamo recompiles and CUDA graph
re-records after warm-up, peak memory, and for vgraph its own counters. Each system gets a wall-clock limit;
one that does not finish is reported with how far it got.

Modules, from the bottom up: ``timing`` (clocks and capture counts), ``flops`` (FLOPs split into attention and
the rest, the roofline they bound, and the MFU's denominator), ``install`` (which install a run had, and its
versions), ``kernel_profile`` (device time by kind of kernel), ``tile_towers`` (the fixed-tile towers benchmarked),
``workload`` (the fixed cases and the seeded requests as grids), ``result`` (one system's
measures), ``systems`` (how each system is built), ``oracle`` (the exact-shape oracle), ``harness`` (runs every
system on one workload), ``targets`` and ``report`` (verdicts, tables, JSON and plot), ``second_start`` (the
warm-up again in a fresh process) and ``cli`` (``vgraph-bench``). ``benchmarks/*.py`` import what they need from
these modules.
"""
