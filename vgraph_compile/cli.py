"""``vgraph explain``: the bucket x bound table of a geometry and its sympy derivation; with ``--module``, also
the input roles the backend discovers in an encoder; with ``--family``, the tier that serves a transformers
family's tower (whole-tower graph or block graphs) and why. ``vgraph precompile``: compile an encoder
(``module:factory``) or the vision tower of a model directory ahead of time and save the compiled artifact and build
plan (``compile/artifacts``, ``warm_start``) that a later process, or a container image, starts from with no trace
and no compile. ``vgraph serve``: transformers' OpenAI-compatible server with vgraph serving every VLM's tower
(``vgraph_compile.hf.server``); options after the model directory that are not vgraph's go to ``transformers serve``.

    vgraph explain --patch-size 14 --window-size 112 --budgets 1024 4096 16384 --max-items 8
    vgraph explain ... --module vgraph_compile.sample_models.explain_factories:windowed_vit
    vgraph explain --family cosmos3_edge [--tiny]     # the tier that serves the tower, and why
    vgraph precompile vgraph_compile.sample_models.explain_factories:cls_vit --options '{"token_budgets": [64, 128]}' \
        --artifact-dir DIR
    vgraph precompile MODEL_DIR --artifact-dir DIR --device cuda
    vgraph serve MODEL_DIR --artifact-dir DIR --port 8000 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

from vgraph_compile.geometry import VisionGeometry

__all__ = ["main", "explain"]

STARTED = time.perf_counter()
"""When this module was imported: ``vgraph serve``'s start-up time counts from it."""


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
    from vgraph_compile.sample_models.vision_utils_towers import build_tower, tower_call

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


def vgraph_options(args: argparse.Namespace) -> dict:
    """``compile_vlm`` options from the command line: ``--options`` JSON, then the named flags over it."""
    options = json.loads(args.options)
    named = {
        "token_budgets": args.budgets, "max_items": args.max_items, "max_frames": args.max_frames,
        "artifact_dir": args.artifact_dir,
    }  # fmt: skip
    return options | {name: value for name, value in named.items() if value is not None}


def precompile_model(args: argparse.Namespace) -> str:
    """Load the model directory as ``vgraph serve`` does (same device, dtype and options), serve its tower with
    vgraph and warm it up: the plans and compiled tower are saved where ``vgraph serve`` with the same options
    finds them."""
    from vgraph_compile.counters import counters
    from vgraph_compile.hf.server import manager_class

    options = vgraph_options(args)
    before = counters.snapshot()
    manager = manager_class(options)(device=args.device, dtype=args.dtype, model_timeout=-1)
    manager.load_model_and_processor(manager.process_model_name(args.factory))
    if not all(manager.vgraph_served.values()):
        raise SystemExit(f"vgraph precompile: {args.factory}: vgraph does not serve its tower (see the warning)")
    moved = {name: value - before[name] for name, value in counters.snapshot().items()}
    if moved["plans_saved"]:
        return f"{args.factory}: saved (build plans and compiled tower: vgraph serve with these options compiles none)"
    if moved["plans_loaded"]:
        return f"{args.factory}: already saved (build plans and compiled tower)"
    raise SystemExit("vgraph precompile: nothing was saved (see the warnings above)")


def precompile(args: argparse.Namespace) -> str:
    """A model directory: ``precompile_model``. Else compile ``module:factory``'s encoder with the options its
    server uses (the artifacts are keyed on them and on the first call's structure, so serve with the same options
    and inputs of the same kind through ``vgraph_compile.encoder``) and save the compiled artifact and build plan."""
    import torch

    import vgraph_compile
    from vgraph_compile.compile import artifacts
    from vgraph_compile.counters import counters

    if not artifacts.available():
        raise SystemExit(f"vgraph precompile: torch {torch.__version__} has no torch._inductor.standalone_compile")
    if os.path.isdir(args.factory):
        return precompile_model(args)
    options = vgraph_options(args)
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

    from vgraph_compile.entry.backend import VGraphBackend
    from vgraph_compile.config import VGraphConfig
    from vgraph_compile.entry.trace_options import trace_options
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
    command.add_argument("factory", help="a model directory, or module:factory returning (encoder, example_args)")
    add_vgraph_options(command)
    command.add_argument("--device", default="auto", help="a model directory's device, as vgraph serve's --device")
    command.add_argument("--dtype", default="auto", help="a model directory's dtype, as vgraph serve's --dtype")
    command = commands.add_parser(
        "serve",
        help="transformers' OpenAI-compatible server with vgraph serving every VLM's vision tower",
        description="Options not listed here go to transformers serve (see transformers serve --help).",
        allow_abbrev=False,
    )
    command.add_argument("model_dir", help="the model to load at start-up: a local directory or a hub id")
    add_vgraph_options(command)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        log_to_stderr()
        return serve(args, rest)
    try:
        print(explain(args) if args.command == "explain" else precompile(args))
    except ValueError as error:
        sys.exit(f"vgraph {args.command}: {error}")


def add_vgraph_options(command: argparse.ArgumentParser) -> None:
    """The options ``vgraph_options`` reads (``vgraph precompile`` and ``vgraph serve`` take the same)."""
    command.add_argument("--options", default="{}", help="vgraph options as JSON (VGraphConfig fields...)")
    command.add_argument("--budgets", type=int, nargs="+", help="token budgets of a packed tower (patches)")
    command.add_argument("--max-items", type=int, help="images (or tiles) one graph call holds")
    command.add_argument("--max-frames", type=int, help="temporal patches one graph call of a packed tower holds")
    command.add_argument(
        "--artifact-dir", help="saved plans and artifacts (default: VGRAPH_ARTIFACT_DIR, else inductor's cache)"
    )


def log_to_stderr() -> None:
    """vgraph's INFO lines (the start-up time, which towers are served) on stderr, as transformers' are."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("vgraph_compile")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def serve(args: argparse.Namespace, rest: list[str]) -> None:
    """``transformers serve MODEL_DIR REST`` with vgraph's tower in every VLM it loads."""
    from vgraph_compile.hf import server

    server.serve([args.model_dir, *rest], server.manager_class(vgraph_options(args), started=STARTED))



if __name__ == "__main__":
    main()
