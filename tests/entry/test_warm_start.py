"""Warm start: a later process serves an encoder from its saved build plan, with no dynamo trace and no compile;
the checks rebuilt from the plan refuse bad input as the traced ones do; a plan of another model, config or call
is never used, and a damaged one is rebuilt. Each test saves into its own ``tmp_path``."""

import hashlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.entry.warm_start import BuildPlan, GraphPlan
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

CALLS = ([5, 7], [30, 20], [3])
"""One call per bucket and one more: 16- and 64-token buckets."""
OPTIONS = {"token_budgets": (16, 64), "max_segments": 4, "attention_backend": "sdpa"}

# A first compile: 1 trace, 1 site, its kernel set in the eager and compiled copies (2 rewrites), 2 buckets, 3 calls,
# and 2 plans saved: the decorator's and the backend's graph plan.
FIRST = dict(traces=1, sites_found=1, nodes_rewritten=2, buckets_built=2, replays=3, plans_saved=2)
# Served from the plan: its buckets allocated, 3 calls replayed; nothing traced, analyzed, rewritten or compiled.
WARM = dict(plans_loaded=1, buckets_built=2, replays=3)

SERVE = """
import json, sys, torch
import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.entry.warm_start import BuildPlan, GraphPlan
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images
torch.manual_seed(int(sys.argv[2]))
model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
compiled = vgraph_compile.encoder(model, token_budgets=(16, 64), max_segments=4, attention_backend="sdpa",
                                  artifact_dir=sys.argv[1])
errors = []
with torch.no_grad():
    for lengths in json.loads(sys.argv[3]):
        inputs = pack_images(lengths, 12)
        out, ref = compiled(*inputs), model(*inputs)
        errors.append(bool(out.isfinite().all()) and ((out - ref).abs().max() / ref.abs().max()).item())
frames = torch._dynamo.utils.counters["frames"]["total"]
print(json.dumps({"counters": counters.snapshot(), "frames": frames, "errors": errors}))
"""


def _model(seed: int = 0, dim: int = 16) -> PackedViT:
    torch.manual_seed(seed)
    return PackedViT(patch_dim=12, dim=dim, depth=1, heads=2, out_dim=8).eval()


def _serve(model, directory: Path, **options):
    """A fresh encoder over ``model`` (dynamo reset, as in a new process) serving ``CALLS``, each eager-equal."""
    torch._dynamo.reset()
    compiled = vgraph_compile.encoder(model, artifact_dir=str(directory), **{**OPTIONS, **options})
    with torch.no_grad():
        for lengths in CALLS:
            inputs = pack_images(lengths, 12)
            out = compiled(*inputs)
            assert out.isfinite().all()
            torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    return compiled


def _plans(directory: Path, kind: type = BuildPlan) -> list[Path]:
    """The plans of ``kind`` saved in ``directory`` (the decorator's ``BuildPlan``s, or the backend's)."""
    return sorted(path for path in directory.glob("*.plan") if type(pickle.loads(path.read_bytes())) is kind)


def test_a_second_process_serves_with_no_trace_and_no_compile(tmp_path, new_process):
    """The first process traces, compiles with inductor and saves; a new process with other weights serves every
    call from the plan and the compiled artifact: no dynamo frame, no trace, no compile, its own weights read,
    every call replayed and eager-equal."""
    with counters.expect(**FIRST, compiles=1, artifacts_saved=1):
        _serve(_model(), tmp_path)
    child = new_process(SERVE, str(tmp_path), "1", json.dumps(CALLS))
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    moved = {name: value for name, value in report["counters"].items() if value}
    assert moved == {**WARM, "artifacts_loaded": 1}
    assert report["frames"] == 0
    assert all(error is not False and error <= 1e-5 for error in report["errors"]), report["errors"]


BAD_CALLS = {
    "patches in float64": lambda: pack_images([5, 7], 12, dtype=torch.float64),
    "patches 13 wide": lambda: pack_images([5, 7], 13),
    "cu_seqlens ending short": lambda: (torch.randn(12, 12), torch.tensor([0, 5, 10], dtype=torch.int32), 7),
}


def _refusals(compiled) -> dict[str, str]:
    messages = {}
    for name, make in BAD_CALLS.items():
        with pytest.raises(ValueError) as refused, torch.no_grad():
            compiled(*make())
        messages[name] = str(refused.value)
    return messages


def test_the_checks_rebuilt_from_a_plan_refuse_bad_input_as_the_traced_ones(tmp_path):
    """Served from the plan (no trace), each bad call raises the ValueError the traced encoder raises, before
    any bucket runs; the encoder's own forward runs for none of them."""
    model = _model()
    with counters.expect(**FIRST):
        traced = _serve(model, tmp_path, compiler="eager")
    expected = _refusals(traced)
    with counters.expect(**WARM):
        warm = _serve(model, tmp_path, compiler="eager")
    with counters.expect():
        assert _refusals(warm) == expected
    assert "float64" in expected["patches in float64"] and "end at the row count 12" in expected["cu_seqlens ending short"]


def _new_plan(directory: Path, before: list[Path]) -> Path:
    (plan,) = set(_plans(directory)) - set(before)
    return plan


def test_a_plan_of_another_model_config_or_call_is_never_used(tmp_path, caplog):
    """Other budgets, another width, or a first call of another structure trace and save a plan of their own;
    the same model with other weights serves from the first plan, with its own weights; a plan put under
    another's key (a copied file) is refused by the key saved with it."""
    with counters.expect(**FIRST):
        _serve(_model(), tmp_path, compiler="eager")
    first = _plans(tmp_path)
    with counters.expect(**{**FIRST, "buckets_built": 3}):
        _serve(_model(), tmp_path, compiler="eager", token_budgets=(16, 32, 64))
    other_budgets = _new_plan(tmp_path, first)
    with counters.expect(**FIRST):
        _serve(_model(dim=24), tmp_path, compiler="eager")
    torch._dynamo.reset()
    compiled = vgraph_compile.encoder(_model(), artifact_dir=str(tmp_path), compiler="eager", **OPTIONS)
    patches, cu_seqlens, max_seqlen = pack_images([5, 7], 12)
    # a keyword: another call structure, so another decorator plan; dynamo's trace of it is the same graph, which
    # the backend serves from the first call's graph plan
    with torch.no_grad(), counters.expect(traces=1, plans_loaded=1, plans_saved=1, buckets_built=2, replays=1):
        compiled(patches, cu_seqlens, max_seqlen=max_seqlen)
    assert len(_plans(tmp_path)) == 4 and len(_plans(tmp_path, GraphPlan)) == 3
    with counters.expect(**WARM):
        _serve(_model(seed=7), tmp_path, compiler="eager")
    (original,) = first
    other_budgets.write_bytes(original.read_bytes())  # the first plan under the other budgets' key
    Path(f"{other_budgets}.json").write_text(Path(f"{original}.json").read_text())
    # refused; traced again, the trace served from its graph plan (no analyses), the decorator's plan saved again
    with caplog.at_level(logging.WARNING), counters.expect(traces=1, plans_loaded=1, plans_saved=1, buckets_built=3,
                                                           replays=3):  # fmt: skip
        _serve(_model(), tmp_path, compiler="eager", token_budgets=(16, 32, 64))
    assert "was saved for another build" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "garbage with its hash", "another object"])
def test_a_damaged_plan_is_rebuilt(tmp_path, caplog, damage):
    """A damaged plan is logged, removed, traced (the trace served from the backend's graph plan) and saved again;
    never used. The rebuilt one serves."""
    _serve(_model(), tmp_path, compiler="eager")
    (plan,) = _plans(tmp_path)
    record = Path(f"{plan}.json")
    if damage == "truncated":
        plan.write_bytes(plan.read_bytes()[: plan.stat().st_size // 2])
    else:
        plan.write_bytes(b"not a plan" * 100 if damage.startswith("garbage") else __import__("pickle").dumps([1, 2]))
        meta = json.loads(record.read_text())
        meta["sha256"] = hashlib.sha256(plan.read_bytes()).hexdigest()
        record.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING), counters.expect(traces=1, plans_loaded=1, plans_saved=1, buckets_built=2,
                                                           replays=3):  # fmt: skip
        _serve(_model(), tmp_path, compiler="eager")  # traced again, served from the backend's graph plan
    assert "build plan" in caplog.text and "building it again" in caplog.text
    with counters.expect(**WARM):
        _serve(_model(), tmp_path, compiler="eager")


def test_torch_compile_serves_a_trace_built_before_from_its_graph_plan(tmp_path):
    """Through torch.compile dynamo traces in every process (before any backend runs); the backend serves a trace
    it built before from the saved graph plan: no analyses, no rewrites, no compile, the parameters dynamo passes
    bound, every call replayed and eager-equal, bad input refused as before."""
    config = vgraph_compile.VGraphConfig(compiler="eager", artifact_dir=str(tmp_path), **OPTIONS)
    model = _model()

    def serve():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=vgraph_compile.VGraphBackend(config), dynamic=True)
        with torch.no_grad():
            for lengths in ([5, 8], [30, 20], [3]):  # not 12 tokens first: they would share the width's symbol
                inputs = pack_images(lengths, 12)
                torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
            with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease and end at the row"):
                compiled(*BAD_CALLS["cu_seqlens ending short"]())

    # 1 site; rewritten in the eager and compiled copies: its kernel and the 3 norms' eps (0-d inputs under plain
    # torch.compile) = 2 * (1 + 3)
    with counters.expect(traces=1, sites_found=1, nodes_rewritten=8, buckets_built=2, replays=3, plans_saved=1):
        serve()
    with counters.expect(traces=1, plans_loaded=1, buckets_built=2, replays=3):
        serve()


def test_a_plan_made_before_a_kernel_package_was_installed_is_not_the_plan_after(tmp_path, monkeypatch):
    """The plan's key holds the optional kernel packages' versions: a plan whose kernels were chosen without
    flash-attn-4 (the plain install) is not loaded once it is installed (the GPU install)."""
    from vgraph_compile.config import VGraphConfig
    from vgraph_compile.entry import warm_start
    from vgraph_compile.kernels import registry

    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    config = VGraphConfig(**OPTIONS, artifact_dir=str(tmp_path))
    args = pack_images([5, 7], 12)
    plain = warm_start.plan_key(model, config, args, {})
    installed = {**registry.installed_packages(), "flash-attn-4": "4.0.0b36"}
    monkeypatch.setattr(registry, "installed_packages", lambda: installed)
    assert warm_start.plan_key(model, config, args, {}) != plain
