"""``vgraph explain``: the bucket x bound table of a geometry and its sympy derivation; with ``--module``, also
the input roles the backend discovers in an encoder; with ``--family``, the tier that serves a transformers
family's tower (whole-tower graph or block graphs) and why. ``vgraph precompile``: compile an encoder ahead of time and
save the compiled artifact and build plan (``compile/artifacts``, ``warm_start``) that a later process, or a
container image, starts from with no trace and no compile.

    vgraph explain --patch-size 14 --window-size 112 --budgets 1024 4096 16384 --max-items 8
    vgraph explain ... --module vgraph_compile.models.examples:windowed_vit
    vgraph explain --family cosmos3_edge [--tiny]     # the tier that serves the tower, and why
    vgraph precompile vgraph_compile.models.examples:cls_vit --options '{"token_budgets": [64, 128]}' --artifact-dir DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from vgraph_compile.geometry import VisionGeometry

__all__ = ["main", "explain"]


def bound_table(geometry: VisionGeometry, budgets, max_items: int, max_frames: int | None) -> str:
    rows = [geometry.bounds(budget, max_items, max_frames).as_dict() for budget in budgets]
    keys = list(rows[0])
    lines = ["  ".join(f"{key:>17}" for key in keys)]
    lines += ["  ".join(f"{bounds[key]:>17}" for key in keys) for bounds in rows]
    return "\n".join(lines)


def explain(args: argparse.Namespace) -> str:
    if args.family:
        return family_tier(args.family, args.tiny)
    if args.patch_size is None:
        raise ValueError("explain takes --patch-size (a geometry's bucket table) or --family (a tower's tier)")
    geometry = VisionGeometry(args.patch_size, args.temporal_patch_size, args.spatial_merge_size, args.window_size)
    parts = [
        f"{geometry}, max_items={args.max_items}, max_frames={args.max_frames or args.max_items}",
        bound_table(geometry, args.budgets, args.max_items, args.max_frames),
        "derivation (B: budget in patches, F: max frames, m: spatial merge, w: window in merged tokens):",
        geometry.bounds(args.budgets[-1], args.max_items, args.max_frames).explain(),
    ]
    if args.module:
        parts += ["discovered input roles:", _module_roles(args.module, geometry, args)]
    return "\n".join(parts)


def family_tier(name: str, tiny: bool) -> str:
    """Which tier serves the family's tower (random weights), and why: the whole-tower graph, or block graphs with
    the host op that keeps the whole forward from being one graph, and the block program recorded on one call."""
    import torch

    from vgraph_compile.hf import CompiledBlockTower, compile_vision_tower
    from vgraph_compile.models.hf_families import build_tower, tower_call

    tower = build_tower(name, tiny=tiny)
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager")
    if isinstance(served, CompiledBlockTower):
        args, kwargs = tower_call(name, tower, [(1, 8, 8)])
        with torch.no_grad():
            served(*args, **kwargs)  # records the block program
    return f"{name} ({type(tower).__name__}): " + served.stats_table().splitlines()[0]


def _factory(spec: str):
    """``(encoder, example_args)`` from ``module:factory``."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise SystemExit(f"vgraph: takes module:factory (a factory returning (encoder, example_args)), got {spec!r}")
    return getattr(importlib.import_module(module_name), attribute)()


def precompile(args: argparse.Namespace) -> str:
    """Compile ``module:factory``'s encoder with the options its server uses (the artifacts are keyed on them and
    on the first call's structure, so serve with the same options and inputs of the same kind through
    ``vgraph_compile.encoder``) and save the compiled artifact and build plan."""
    import torch

    import vgraph_compile
    from vgraph_compile.compile import artifacts
    from vgraph_compile.counters import counters

    if not artifacts.available():
        raise SystemExit(f"vgraph precompile: torch {torch.__version__} has no torch._inductor.standalone_compile")
    options = json.loads(args.options)
    if args.artifact_dir is not None:
        options["artifact_dir"] = args.artifact_dir
    encoder, example_args = _factory(args.factory)
    before = counters.snapshot()
    compiled = vgraph_compile.encoder(encoder, **options)
    with torch.no_grad():
        compiled(*example_args)
    moved = {name: value - before[name] for name, value in counters.snapshot().items()}
    if moved["plans_saved"] or moved["plans_loaded"]:
        done = "saved" if moved["plans_saved"] else "already saved"
        return f"{args.factory}: {done} (build plan and compiled encoder: later starts neither trace nor compile)"
    if moved["artifacts_saved"] or moved["artifacts_loaded"]:
        done = "saved" if moved["artifacts_saved"] else "already saved"
        return f"{args.factory}: {done} (compiled encoder only, no build plan: later starts trace, see the log)"
    raise SystemExit("vgraph precompile: nothing was saved (see the warnings above)")


def _module_roles(spec: str, geometry: VisionGeometry, args: argparse.Namespace) -> str:
    """Trace ``module:factory`` (a callable returning ``(encoder, example_args)``) and print its spec."""
    import torch

    from vgraph_compile.compile_backend import VGraphBackend
    from vgraph_compile.config import VGraphConfig
    from vgraph_compile.decorator import trace_options
    from vgraph_compile.analyze.bounds import output_ranges

    encoder, example_args = _factory(spec)
    config = VGraphConfig(
        token_budgets=tuple(args.budgets),
        geometry=geometry,
        max_items=args.max_items,
        max_frames=args.max_frames,
        compiler="eager",
    )
    backend = VGraphBackend(config)
    with trace_options(example_args), torch.no_grad():
        torch.compile(encoder, backend=backend, dynamic=True, fullgraph=True)(*example_args)
    runtime = backend.runtimes[-1]
    lines = [runtime.spec.format()]
    for bucket in runtime.buckets:
        outputs = "; ".join(
            "[" + ", ".join(f"{r.lower}..{r.upper}" for r in dims) + "]"
            for dims in output_ranges(runtime.spec, bucket.shape)
        )
        lines.append(f"{bucket.shape.format(runtime.spec)}; outputs {outputs}")
    kernels = ", ".join(f"group {group}: {name}" for group, name in sorted(runtime.encoder.kernels.items()))
    lines.append(f"attention kernels: {kernels}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vgraph")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("explain", help="bucket x bound table and derivation for a geometry")
    command.add_argument("--patch-size", type=int, help="the geometry's patch size (with --family: not needed)")
    command.add_argument("--temporal-patch-size", type=int, default=2)
    command.add_argument("--spatial-merge-size", type=int, default=2)
    command.add_argument("--window-size", type=int, default=None, help="window side in pixels (Qwen2.5-VL: 112)")
    command.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096, 16384])
    command.add_argument("--max-items", type=int, default=8)
    command.add_argument("--max-frames", type=int, default=None)
    command.add_argument("--module", help="path:attr of a factory returning (encoder, example_args)")
    command.add_argument("--family", help="a transformers vision_utils family: which tier serves its tower, and why")
    command.add_argument("--tiny", action="store_true", help="with --family: the shrunk tower (fast, on the CPU)")
    command = commands.add_parser("precompile", help="compile an encoder ahead of time and save the artifact")
    command.add_argument("factory", help="module:factory returning (encoder, example_args)")
    command.add_argument("--options", default="{}", help="vgraph options as JSON, the same as the server's")
    command.add_argument("--artifact-dir", help="where to save (default: VGRAPH_ARTIFACT_DIR, else inductor's cache)")
    args = parser.parse_args(argv)
    try:
        print(explain(args) if args.command == "explain" else precompile(args))
    except ValueError as error:
        sys.exit(f"vgraph {args.command}: {error}")


if __name__ == "__main__":
    main()
