"""Shared test helpers: tracing an encoder the way the backend sees it, graph snapshots, references."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch._dynamo.testing import normalize_gm
from torch._guards import detect_fake_mode

from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.entry.trace_options import trace_options
from vgraph_compile.kernels.segments import cu_seqlens
from vgraph_compile.spec import PassContext


def trace(
    model, *args, config: VGraphConfig | None = None, static_widths: bool = True, plain: bool = False
) -> tuple[torch.fx.GraphModule, PassContext]:
    """The dynamo graph and a fresh ``PassContext`` for ``model(*args)``, as the vgraph backend receives them
    (``static_widths=False``: trailing dims left symbolic, as plain ``torch.compile(dynamic=True)`` leaves them;
    ``plain=True``: traced exactly as plain ``torch.compile(dynamic=True)`` traces, without the decorator's options)."""
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        captured["shape_env"] = detect_fake_mode(example_inputs).shape_env
        return gm.forward

    torch._dynamo.reset()
    with contextlib.nullcontext() if plain else trace_options(args if static_widths else ()):
        torch.compile(model, backend=capture, dynamic=True, fullgraph=True)(*args)
    gm, inputs = captured["gm"], captured["inputs"]
    device = next(value.device for value in inputs if isinstance(value, torch.Tensor))
    ctx = PassContext(inputs, captured["shape_env"], config or VGraphConfig(token_budgets=(64, 256)), device)
    return gm, ctx


@contextlib.contextmanager
def counter_changes() -> Iterator[dict[str, int]]:
    """The change of every counter over the block, filled in when it exits (for checks on a few counters where a
    block may also retrace; ``counters.expect`` checks them all)."""
    before = counters.snapshot()
    changes: dict[str, int] = {}
    yield changes
    changes.update({name: value - before[name] for name, value in counters.snapshot().items()})


def outputs_from_threads(call: Callable[[int], Any], threads: int, repeats: int = 5) -> list[list[Any]]:
    """``call(index)`` made ``repeats`` times on each of ``threads`` threads at once (thread ``index`` passes its own
    index), under ``torch.no_grad`` in each thread (grad mode is per thread): each thread's outputs, in order. A
    thread's exception is raised here."""
    import concurrent.futures

    def run(index: int) -> list[Any]:
        with torch.no_grad():
            return [call(index) for _ in range(repeats)]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(run, range(threads)))


def graph_str(gm: torch.fx.GraphModule) -> str:
    """``print_readable`` without comments or file paths, for inline snapshots."""
    return normalize_gm(gm.print_readable(print_output=False))


def op_count(gm: torch.fx.GraphModule, target) -> int:
    return sum(1 for node in gm.graph.nodes if node.target is target)


def segment_reference(q, k, v, cu_seqlens, scale=None) -> torch.Tensor:
    """Per-segment attention in float64, rows past the last offset zero: the ground truth for every backend."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def run_backend(name: str, q, k, v, cu_seqlens, max_seqlen: int, scale=None) -> torch.Tensor:
    """``name``'s attention through its op: token ``cu_seqlens`` as they are, or, for a packed backend, the
    ``[Q/K/O | V]`` element offsets of contiguous q/k/v."""
    from vgraph_compile.kernels import registry
    from vgraph_compile.kernels.ops import qkv_offsets_varlen_attention, varlen_attention

    if not registry.BACKENDS[name].qkv_offsets:
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, backend=name)
    q, k, v = (t.contiguous() for t in (q, k, v))
    row = q.shape[1] * q.shape[2]
    offsets = torch.cat([cu_seqlens * row, cu_seqlens * row])
    return qkv_offsets_varlen_attention(q, k, v, offsets, max_seqlen, scale=scale, backend=name)


def isolation_case(
    lengths, padding, poisoned, tensor, row, value, heads=2, head_dim=8, dtype=torch.float32, device="cpu", seed=0
):
    """Random packed q/k/v, ``cu_seqlens``, and a copy of q/k/v with ``value`` planted at row ``row`` of segment
    ``poisoned`` in q, k or v (``tensor`` 0, 1, 2)."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(lengths) + padding
    clean = [torch.randn(rows, heads, head_dim, generator=generator).to(device, dtype) for _ in range(3)]
    cu = cu_seqlens(lengths)
    dirty = [t.clone() for t in clean]
    dirty[tensor][int(cu[poisoned]) + row, row % heads, row % head_dim] = value
    return clean, dirty, cu.to(device)


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported as a module (the scripts are not a package)."""
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
"""Whether ``HYPOTHESIS_PROFILE=thorough`` runs: the tests that sweep many configs or every family run then (read
from the environment, so the test processes' own children, the gloo ranks, see it too)."""
