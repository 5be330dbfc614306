"""Saved compiled encoders: a second process loads instead of compiling; a corrupt or foreign artifact is never
used. Each test saves into its own ``tmp_path``."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import PackedViT, pack_images

ROOT = Path(__file__).resolve().parents[2]
CALLS = ([5, 7], [30, 20], [3])
"""One call per bucket and one more: 16- and 64-token buckets."""

SERVE = """
import json, sys, torch
import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.models.packed_vit import PackedViT, pack_images
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
print(json.dumps({"counters": counters.snapshot(), "errors": errors}))
"""


def _serve(directory: Path, seed: int, **options) -> None:
    """Compile the one-block encoder (fresh dynamo state) and check its calls against eager."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = PackedViT(patch_dim=12, dim=16, depth=1, heads=2, out_dim=8).eval()
    options = {"token_budgets": (16, 64), "max_segments": 4, "attention_backend": "sdpa", **options}
    compiled = vgraph_compile.encoder(model, artifact_dir=str(directory), **options)
    with torch.no_grad():
        for lengths in CALLS:
            inputs = pack_images(lengths, 12)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def _artifacts(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.bin"))


# A first compile: 1 trace, 1 site, its kernel set in the eager and compiled copies (2 rewrites), 2 buckets, 3 calls.
FIRST = dict(traces=1, sites_found=1, nodes_rewritten=2, buckets_built=2, replays=3)


def test_a_second_process_serves_from_the_saved_artifact(tmp_path):
    """The first compile saves; a new process with other weights loads it: no inductor compile there, its own
    weights read, every call replayed and eager-equal."""
    with counters.expect(**FIRST, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path), "1", json.dumps(CALLS)],
        capture_output=True, text=True, cwd=ROOT, env=environment, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    moved = {name: value for name, value in report["counters"].items() if value}
    assert moved == {**FIRST, "artifacts_loaded": 1}
    assert all(error is not False and error <= 1e-5 for error in report["errors"]), report["errors"]


@pytest.mark.parametrize("damage", ["truncated", "garbage with its hash"])
def test_a_corrupt_artifact_is_rebuilt(tmp_path, caplog, damage):
    """A damaged artifact is logged, compiled again and saved again; never loaded."""
    _serve(tmp_path, seed=0)
    (binary,) = _artifacts(tmp_path)
    record = binary.with_suffix(".json")
    if damage == "truncated":
        binary.write_bytes(binary.read_bytes()[: binary.stat().st_size // 2])
    else:
        binary.write_bytes(b"not an artifact" * 100)
        meta = json.loads(record.read_text())
        meta["sha256"] = __import__("hashlib").sha256(binary.read_bytes()).hexdigest()
        record.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING), counters.expect(**FIRST, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0)
    assert "compiling again" in caplog.text
    assert _artifacts(tmp_path) == [binary] and binary.stat().st_size > 1500
    with counters.expect(**FIRST, artifacts_loaded=1):  # the rebuilt one loads
        _serve(tmp_path, seed=0)


def test_an_artifact_of_another_model_or_config_is_never_used(tmp_path, caplog):
    """Other budgets or another width compile their own artifact; another model's artifact put under this key
    (a copied file) is refused by the key saved with it; the same model with other weights loads."""
    _serve(tmp_path, seed=0)
    (first,) = _artifacts(tmp_path)
    with counters.expect(**{**FIRST, "buckets_built": 3}, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0, token_budgets=(16, 32, 64))
    assert len(_artifacts(tmp_path)) == 2
    second = next(path for path in _artifacts(tmp_path) if path != first)
    second.write_bytes(first.read_bytes())  # the first model's artifact under the second's name
    second.with_suffix(".json").write_text(first.with_suffix(".json").read_text())
    with caplog.at_level(logging.WARNING), counters.expect(**{**FIRST, "buckets_built": 3}, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0, token_budgets=(16, 32, 64))
    assert "was saved for another compile" in caplog.text
    with counters.expect(**FIRST, artifacts_loaded=1):
        _serve(tmp_path, seed=7)
