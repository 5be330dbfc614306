"""The compile stage: one inductor compile of the rewritten graph for every bucket, and what assembly makes of it.

Order, and why:
1. ``repeated_blocks``: the transformer blocks that repeat become calls of one shared subgraph, so inductor
   compiles a block once, not once per layer (first: it reshapes what ``inductor`` compiles).
2. ``inductor``: one compile, symbolic in every token and segment size; inductor's guards are checked at each
   bucket's sizes, and a bucket they exclude is dropped with its reason.
3. ``artifacts``: the compiled code and the build plan saved on disk for a later process, under keys that hash
   what shapes them.
4. ``buckets``: per bucket, persistent input buffers over shared storages and, on CUDA, one captured graph.
5. ``assemble``: the pipeline's last stage; parameters bound (aligned weights sharing the module's storage),
   kernels prepared, buckets allocated. Capturing the graphs waits for the first call (``serve/runtime``).

This stage never fills buffers for a call: ``serve/fills`` does, and hands ``buckets.capture`` its empty fill.
"""
