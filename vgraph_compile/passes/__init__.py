"""FX passes of the vgraph pipeline: analyses ``discover_varlen`` -> ``bounds``, then the rewrites
``select_kernel`` -> ``lower_packed`` -> ``align_matmuls``.

Each pass is ``run(gm, ctx) -> gm``; ``pass_manager`` states their order.
"""
