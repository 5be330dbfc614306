import pytest

from tests.bench.test_cli import TOY_ARGS
from vgraph_compile.bench.cli import main

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)


def test_second_start_runs_the_warmup_again_in_a_fresh_process_with_the_same_cache(tmp_path):
    cache = tmp_path / "inductor"
    report = main(
        [*TOY_ARGS, "--systems", "hf_eager_sdpa", "--warmup-only", "--second-start", "--cache-dir", str(cache)]
    )
    assert report["inductor_cache_dir"] == report["second_start_inductor_cache_dir"] == str(cache)
    assert "second_start_warmup_s" in report["systems"]["hf_eager_sdpa"]
    assert "second_start_status" not in report["systems"]["hf_eager_sdpa"]
