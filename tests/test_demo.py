"""The README's first command, ``examples/demo.py``, as a new user runs it: a child process on the CPU with a
cold inductor cache of its own. It must exit 0, serve its calls from the buckets and match eager."""

import os
import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
REQUESTS = 2


def test_demo_runs_on_a_cold_cache(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, str(DEMO), "--requests", str(REQUESTS), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (difference,) = re.findall(r"^max relative difference vs eager: (\S+)$", done.stdout, re.MULTILINE)
    assert float(difference) <= 1e-5, done.stdout
    hits = [int(row[1]) for row in re.findall(r"^\s+(\d+)\s+\[\d+\]\s+\[\d+\]\s+(\d+)\s", done.stdout, re.MULTILINE)]
    # the warm-up call and each request are served by a bucket; the request over the largest budget runs eagerly
    assert sum(hits) == REQUESTS + 1, done.stdout
    assert "eager fallback x1: no bucket holds" in done.stdout, done.stdout
    assert any(path.is_file() for path in (tmp_path / "inductor").rglob("*")), "inductor wrote outside the new cache"
