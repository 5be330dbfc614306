"""Saved compiled encoders: a corrupt or foreign artifact is never used, and the build plan that needs it is
rebuilt with it (a second process serving from both: ``tests/entry/test_warm_start.py``). Each test saves into its own
``tmp_path`` (a copy of the module's first save, where a test starts from one)."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import sympy
import torch

import vgraph_compile
from vgraph_compile.compile import artifacts
from vgraph_compile.counters import counters
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images

CALLS = ([5, 7], [30, 20], [3])
"""One call per bucket and one more: 16- and 64-token buckets."""


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


# A first compile: 1 trace, 1 site, its kernel set in the eager and compiled copies (2 rewrites), 2 buckets, 3 calls,
# and 2 plans saved (the decorator's and the backend's graph plan).
FIRST = dict(traces=1, sites_found=1, nodes_rewritten=2, buckets_built=2, replays=3, plans_saved=2)
# Served from the saved plan and artifact: no trace, no compile.
WARM = dict(plans_loaded=1, artifacts_loaded=1, buckets_built=2, replays=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A directory holding what the first compile of the one-block encoder (seed 0, the default options) saved:
    its artifact and two plans, made once for the tests that start from it (the key leaves out the directory)."""
    directory = tmp_path_factory.mktemp("saved")
    with counters.expect(**FIRST, compiles=1, artifacts_saved=1):
        _serve(directory, seed=0)
    return directory


def _copy_of(saved: Path, directory: Path) -> None:
    """The first save, as ``_serve(directory, seed=0)`` would have written it."""
    shutil.copytree(saved, directory, dirs_exist_ok=True)
    assert len(_artifacts(directory)) == 1 and len(list(directory.glob("*.plan"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "garbage with its hash", "unreadable guards"])
def test_a_corrupt_artifact_is_rebuilt(saved, tmp_path, caplog, damage):
    """A damaged artifact is logged, compiled again and saved again, with the plans that named it; never loaded."""
    _copy_of(saved, tmp_path)
    (binary,) = _artifacts(tmp_path)
    record = Path(f"{binary}.json")
    if damage == "truncated":
        binary.write_bytes(binary.read_bytes()[: binary.stat().st_size // 2])
    elif damage == "unreadable guards":  # valid JSON, the binary intact: the record's guards do not parse
        meta = json.loads(record.read_text())
        meta["guards"] = [*meta["guards"], "s0 <="]
        record.write_text(json.dumps(meta))
    else:
        binary.write_bytes(b"not an artifact" * 100)
        meta = json.loads(record.read_text())
        meta["sha256"] = __import__("hashlib").sha256(binary.read_bytes()).hexdigest()
        record.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING), counters.expect(**FIRST, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0)
    assert "compiled artifact" in caplog.text and "building it again" in caplog.text
    assert _artifacts(tmp_path) == [binary] and binary.stat().st_size > 1500
    with counters.expect(**WARM):  # the rebuilt one loads
        _serve(tmp_path, seed=0)


def test_an_artifact_of_another_model_or_config_is_never_used(saved, tmp_path, caplog):
    """Other budgets or another width compile their own artifact; another model's artifact put under this key
    (a copied file) is refused by the key saved with it; the same model with other weights loads."""
    _copy_of(saved, tmp_path)
    (first,) = _artifacts(tmp_path)
    with counters.expect(**{**FIRST, "buckets_built": 3}, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0, token_budgets=(16, 32, 64))
    assert len(_artifacts(tmp_path)) == 2
    second = next(path for path in _artifacts(tmp_path) if path != first)
    second.write_bytes(first.read_bytes())  # the first model's artifact under the second's name
    Path(f"{second}.json").write_text(Path(f"{first}.json").read_text())
    with caplog.at_level(logging.WARNING), counters.expect(**{**FIRST, "buckets_built": 3}, compiles=1, artifacts_saved=1):
        _serve(tmp_path, seed=0, token_budgets=(16, 32, 64))
    assert "was saved for another build" in caplog.text
    with counters.expect(**WARM):
        _serve(tmp_path, seed=7)


def _package_copy(tmp_path: Path) -> Path:
    package = Path(artifacts.__file__).resolve().parent.parent
    copy = tmp_path / "vgraph_compile"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize(
    "path, edit, kept",
    [
        ("bench/report.py", lambda text: text + "\nEXTRA = 1\n", True),
        ("sample_models/packed_vit.py", lambda text: text.replace('"""', '"""A reworded docstring. ', 1), True),
        ("compile/inductor.py", lambda text: text.replace('"""', '"""A reworded docstring. ', 1), True),
        ("rewrite/fold_scalars.py", lambda text: text + "\nEXTRA = 1\n", False),
        ("kernels/segments.py", lambda text: text + "\nEXTRA = 1\n", False),
    ],
)
def test_the_saved_key_follows_the_code_that_shapes_it(tmp_path, path, edit, kept):
    """A benchmark module or a docstring changed keeps every saved plan and artifact (same sources hash); a rewrite
    or a kernel changed drops them."""
    package = _package_copy(tmp_path)
    before = artifacts.sources_hash(package)
    edited = package / path
    edited.write_text(edit(edited.read_text()))
    artifacts.sources_hash.cache_clear()
    assert (artifacts.sources_hash(package) == before) is kept


def test_the_sources_digest_is_parsed_once_per_set_of_file_contents(tmp_path, monkeypatch):
    """The first digest of a package parses its modules and keeps the result under the cache directory; a later
    process (the function's cache cleared) with the same files reads it back without parsing any module."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    package = _package_copy(tmp_path)
    artifacts.sources_hash.cache_clear()
    first = artifacts.sources_hash(package)
    assert (tmp_path / "cache" / "vgraph_sources.json").exists()

    def no_parse(source):
        raise AssertionError("a module was parsed again")

    monkeypatch.setattr(artifacts, "_code", no_parse)
    artifacts.sources_hash.cache_clear()
    assert artifacts.sources_hash(package) == first
    artifacts.sources_hash.cache_clear()


def test_a_loaded_artifact_keeps_its_size_guards(tmp_path):
    """A later trace that loads the compiled code from its artifact (the build plans gone) knows the compile's size
    guards, as the process that compiled it did: its calls run at their exact sizes under ``exact_size``, equal to
    eager, instead of falling back to padding for want of guards."""
    _serve(tmp_path, seed=0, call_choice="exact_size")
    for plan in tmp_path.glob("*.plan*"):
        plan.unlink()
    exact = "compiled code at the exact size"
    with counters.expect(traces=1, sites_found=1, nodes_rewritten=2, buckets_built=2, plans_saved=2,
                         artifacts_loaded=1):  # fmt: skip
        _serve(tmp_path, seed=0, call_choice="exact_size")
    (runtime,) = [runtime for runtime in vgraph_compile.runtimes() if runtime.call_choice == "exact_size"][-1:]
    assert runtime.encoder.record.size_guards is not None and runtime.choices[exact] == len(CALLS)


def test_a_saved_guard_that_reads_true_or_false_loads_as_a_sympy_boolean(saved, tmp_path):
    """A size guard the ShapeEnv's replacements decided is saved as ``True`` or ``False``, which ``sympify`` parses
    to Python's bools; a later trace that loads the artifact (its build plans gone) reads them as sympy's (a Python
    bool has no ``xreplace``: that trace raised ``AttributeError``). ``False`` is kept: no size satisfies it, so
    no call runs the compiled code at its exact sizes."""
    _copy_of(saved, tmp_path)
    (binary,) = _artifacts(tmp_path)
    record = Path(f"{binary}.json")
    meta = json.loads(record.read_text())
    meta["guards"] = [*meta["guards"], "True", "False"]
    record.write_text(json.dumps(meta))
    for plan in tmp_path.glob("*.plan*"):
        plan.unlink()
    with counters.expect(traces=1, sites_found=1, nodes_rewritten=2, buckets_built=2, replays=3, plans_saved=2,
                         artifacts_loaded=1):  # fmt: skip
        _serve(tmp_path, seed=0)
    guards = vgraph_compile.runtimes()[-1].encoder.record.size_guards
    assert guards[-2:] == (sympy.true, sympy.false)
