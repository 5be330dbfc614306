"""The trace options: how dynamo traces an encoder so that one trace serves every size.

The pipeline's first step (``vgraph_compile/pipeline``), applied by the entry points around dynamo's trace (the
decorator, ``vgraph explain``), before the backend's stages run.
"""

from __future__ import annotations

import contextlib

import torch
from torch.fx.experimental import _config as fx_config

from vgraph_compile.pipeline import cudnn_attention

__all__ = ["trace_options"]


def trace_options(args: tuple = ()) -> contextlib.ExitStack:
    """Settings for a trace that serves every size, whatever the first call was.

    Dim 0 of every tensor argument is its packed dim and stays dynamic; trailing dims (feature widths) are
    marked static. No duck sizing: sizes equal by chance in the first call (as many windows as frames, a token
    count equal to a width) must not be tied together; lengths that are equal by construction are related by
    the graph itself (an elementwise op, or ``torch._check(a.shape[0] == b.shape[0])``). Size-oblivious backed
    sizes: a first call with one token or one segment must not specialize that size to 1. Specialized floats:
    module constants (eps, scales) stay constants rather than becoming graph inputs.
    """
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 1:
            torch._dynamo.mark_static(arg, tuple(range(1, arg.dim())))
    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(use_duck_shape=False, backed_size_oblivious=True))
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    stack.enter_context(cudnn_attention(False))
    return stack
