"""Draw configs of every served packed family and the options each is compiled with
(``tests/hf/family_configs.tower_sizes``, ``serving_options``) and serve each draw (``check_served``: inductor
draws on a fresh cache, then on that warm cache), recording every outcome instead of stopping at the first failure:
how many draws per family, how many the stock tower rejected, and each failure with its config, its options and
its first error line.

    PYTHONPATH=. python scripts/family_config_sweep.py --configs 40 --out sweep.json [--families qwen2_5_vl ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VGRAPH_ARTIFACT_DIR", "")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import UnsatisfiedAssumption  # noqa: E402

from tests.hf.family_configs import check_served, serving_options, tower_sizes  # noqa: E402
from tests.hf.test_family_configs import SERVED  # noqa: E402


def sweep(name: str, configs: int, seed: int) -> dict:
    record = {"drawn": 0, "rejected": 0, "failed": 0, "failures": []}

    @settings(max_examples=configs, database=None, deadline=None, derandomize=False, phases=["generate"],
              suppress_health_check=list(HealthCheck))
    @given(fields=tower_sizes(name), options=serving_options())
    def run(fields, options):
        record["drawn"] += 1
        torch._dynamo.reset()
        try:
            check_served(name, fields, options)
        except UnsatisfiedAssumption:
            record["rejected"] += 1
            raise
        except Exception as error:  # recorded, and the draw goes on
            record["failed"] += 1
            where = traceback.extract_tb(error.__traceback__)[-1]
            first = (str(error).splitlines() or [""])[0][:300]
            record["failures"].append({"config": {k: v for k, v in fields.items() if k != "id2label"},
                                       "options": dataclasses.asdict(options),
                                       "error": f"{type(error).__name__}: {first}",
                                       "phase": "; ".join(getattr(error, "__notes__", ())),
                                       "at": f"{where.filename.rsplit('/', 2)[-1]}:{where.lineno}"})

    run._hypothesis_internal_use_seed = seed
    run()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=10, help="configs (each with its options) drawn per family")
    parser.add_argument("--families", nargs="*", help="default: every family the whole-tower graph serves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.families or SERVED
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = sweep(name, args.configs, args.seed)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, {k: v for k, v in results[name].items() if k != "failures"}, flush=True)
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1, default=str)


if __name__ == "__main__":
    main()
