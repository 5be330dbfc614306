"""The ways in: how a user's encoder enters the pipeline (``vgraph_compile/pipeline``).

Order, and why (from the bottom up):
1. ``trace_options``: dynamo's settings for one trace that serves every size.
2. ``warm_start``: saved plans, so a later process skips the analyses, rewrites and compile (and, through the
   decorator, the trace too).
3. ``backend``: the ``"vgraph"`` torch.compile backend; runs the pipeline's stages inside dynamo's call.
4. ``decorator``: ``vgraph_compile.encoder``; traces under ``trace_options`` with the backend, then serves calls
   past dynamo's guards.
"""
