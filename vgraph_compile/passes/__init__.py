"""FX passes of the vgraph pipeline: ``discover_varlen`` -> ``bounds`` -> ``pad_varlen`` -> ``specialize``.

Each pass is ``run(gm, ctx) -> gm``; ``pass_manager`` states their order.
"""
