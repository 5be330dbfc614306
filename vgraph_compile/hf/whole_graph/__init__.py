"""Tier 1, the whole-tower graph: towers whose whole forward is one graph, served by vgraph's bucket graphs.

``tower_call`` (the forward the trace takes, the grid withheld), ``whole_tower`` (packed towers:
``CompiledVisionTower``, its record the runtime's build plan, its runtime ``serve/runtime``), ``batching`` (a
call's items packed into buckets), ``tiles`` (fixed-tile towers bucketed over the tile count). Over a process
group the same graphs serve the parallel modes (``hf/parallel``).
"""
