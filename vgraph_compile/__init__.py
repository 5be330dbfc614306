"""vgraph_compile: vision encoders with packed variable-length attention, run as CUDA graphs for any input.

``torch.compile(encoder, backend="vgraph", dynamic=True, options={"token_budgets": [...]})``, or
``vgraph_compile.encoder(...)``. The ways in are ``entry/``; ``pipeline`` owns the stage order: dynamo trace ->
``analyze`` (sites, input roles, relations, bounds per token budget) -> ``rewrite`` (the kernel choice, then pure
FX rewrites) -> ``compile`` (one inductor compile, symbolic in every size, for all budgets; per budget, buffers
and on CUDA one captured graph) -> ``serve`` (validate, fill, replay, narrow), with the attention ``kernels`` below
and ``hf`` on top. The records every stage reads sit at the root (``spec``, ``config``, ``geometry``, ``symbolic``,
``fx_utils``, ``counters``).
"""

import logging

from vgraph_compile.entry.backend import VGraphBackend, runtimes, vgraph_backend
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.entry.decorator import encoder
from vgraph_compile.geometry import VisionGeometry
from vgraph_compile.kernels.ops import varlen_attention

__all__ = [
    "VGraphBackend",
    "VGraphConfig",
    "VisionGeometry",
    "counters",
    "encoder",
    "runtimes",
    "varlen_attention",
    "vgraph_backend",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str):
    """``vgraph_compile.hf`` imports on first use (it needs transformers only when a tower is compiled)."""
    if name == "hf":
        import importlib

        return importlib.import_module("vgraph_compile.hf")
    raise AttributeError(f"module 'vgraph_compile' has no attribute {name!r}")
