"""FlashInfer (cuDNN) backend against torch's varlen FA2 through vgraph's CUDA graphs (bf16 vs an fp32 reference).

python benchmarks/flashinfer_check.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import vgraph_compile
from vgraph_compile.bench.timing import median_ms
from vgraph_compile.sample_models.packed_vit import PackedViT, pack_images


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    import flashinfer.prefill  # noqa: F401  (fail here, with the real import error, if it cannot load)

    torch.manual_seed(0)
    reference = PackedViT(patch_dim=1176, dim=1024, depth=8, heads=16, out_dim=2048, merge=4).cuda().eval()
    model = PackedViT(patch_dim=1176, dim=1024, depth=8, heads=16, out_dim=2048, merge=4).cuda().eval()
    model.load_state_dict(reference.state_dict())
    model = model.to(torch.bfloat16)
    systems = {
        name: vgraph_compile.encoder(model, token_budgets=(1024, 4096, 16384), max_segments=8, attention_backend=name)
        for name in ("flashinfer", "torch_varlen")
    }
    rng = random.Random(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "errors": {}, "ms": {}}
    with torch.inference_mode():
        for _ in range(20):
            lengths = [4 * rng.randint(16, 900) for _ in range(rng.randint(1, 6))]
            while sum(lengths) > 16384:
                lengths.pop()
            patches, cu, longest = pack_images(lengths, 1176, device="cuda")
            ref = reference(patches, cu, longest).float()
            for name, system in systems.items():
                out = system(patches.bfloat16(), cu, longest).float()
                assert not out.isnan().any(), name
                error = ((out - ref).norm() / ref.norm()).item()
                report["errors"].setdefault(name, []).append(round(error, 5))
        for lengths in ([256], [576] * 4, [9216]):
            patches, cu, longest = pack_images(lengths, 1176, device="cuda", dtype=torch.bfloat16)
            key = f"{len(lengths)}x{lengths[0]}"
            report["ms"][key] = {
                name: round(median_ms(lambda system=system: system(patches, cu, longest)), 3)
                for name, system in systems.items()
            }
        report["graphs"] = {name: system.vgraph.runtimes[0].stats_table() for name, system in systems.items()}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
