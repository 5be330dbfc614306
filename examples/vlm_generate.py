"""A whole Qwen VLM answering about real photographs, stock vs ``compile_vlm``: time to first token and the tokens.

Inputs: two of scikit-image's sample photographs and a video clip panning over a third, made into model inputs
by transformers' image processor (``vgraph_compile.sample_models.qwen_vlms``). CPU (default): a tiny random-weight model,
fp32. CUDA: the released size (Qwen2.5-VL-7B or Qwen3-VL-8B, random weights, bf16). Random weights mean the
generated tokens are arbitrary ids: what matters is that both paths generate the same ones.

    python examples/vlm_generate.py [--model qwen2.5-vl|qwen2-vl|qwen3-vl] [--device cuda|cpu] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from vgraph_compile.hf import compile_vlm
from vgraph_compile.sample_models.qwen_vlms import Item, Request, image_processor, model_inputs, photos, qwen_vlm, video_clip


def generate(model, inputs: dict, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Generated token ids, and the time to the first token in ms."""
    if inputs["input_ids"].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=1, do_sample=False)
    if inputs["input_ids"].is_cuda:
        torch.cuda.synchronize()
    ttft_ms = 1e3 * (time.perf_counter() - start)
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1] :], ttft_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-vl", choices=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    tiny = device.type == "cpu"
    model = qwen_vlm(args.model, tiny=tiny, device=device, dtype=torch.float32 if tiny else torch.bfloat16)
    photo = photos()
    clip = video_clip(photo["astronaut"], frames=4, size=(112, 112) if tiny else (336, 336), step=16)
    requests = [  # a batch of two prompts: two photos and a question; a video and a question
        Request((Item("image", photo["coffee"]), Item("image", photo["chelsea"])), (12, 6, 20), seed=1),
        Request((Item("video", clip),), (8, 30), seed=2),
    ]
    inputs = model_inputs(model, requests, image_processor(model.config, max_patches=256 if tiny else None))
    print(
        f"{args.model} ({'tiny' if tiny else 'released size'}, random weights, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params) on {device}; "
        f"prompt {tuple(inputs['input_ids'].shape)}, image grids {inputs['image_grid_thw'].tolist()}, "
        f"video grid {inputs['video_grid_thw'].tolist()}"
    )
    options = (
        dict(token_budgets=[256, 1024], max_items=4)
        if tiny
        else dict(min_tokens=1024, max_tokens=16384, max_items=8, max_frames=16)
    )
    with torch.inference_mode():
        generate(model, inputs, 1)  # warm up the stock model too
        stock_tokens, stock_ms = generate(model, inputs, args.new_tokens)
        start = time.perf_counter()
        compile_vlm(model, **options)
        generate(model, inputs, 1)
        print(f"compile_vlm + first call (trace, compile, capture every bucket): {time.perf_counter() - start:.1f} s")
        tokens, ms = generate(model, inputs, args.new_tokens)
    print(f"time to first token: stock {stock_ms:.1f} ms, vgraph {ms:.1f} ms ({stock_ms / ms:.2f}x)")
    print(f"stock tokens:  {stock_tokens.tolist()}")
    print(f"vgraph tokens: {tokens.tolist()}  ({'the same' if torch.equal(tokens, stock_tokens) else 'DIFFERENT'})")
    print(model.model.visual.stats_table())
    if tiny:
        print("(On the CPU there is no launch overhead for graphs to remove: see BENCHMARKS.md for GPU numbers.)")


if __name__ == "__main__":
    main()
