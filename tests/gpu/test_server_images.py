"""On a CUDA GPU: ``vgraph serve`` resizes and normalizes a VLM's images on the model's GPU, with the pixels the
host makes. Run with ``pytest -m gpu``."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _smooth_image(height: int, width: int, seed: int) -> np.ndarray:
    """An ``[H, W, 3]`` uint8 image of smooth waves (a photograph's spectrum more than noise's)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phases, scales = rng.uniform(0, 2 * np.pi, 3), rng.uniform(2, 8, 3)
    channels = [np.sin(scale * np.pi * (x + y) + phase) for scale, phase in zip(scales, phases)]
    return np.clip(127.5 * (1 + np.stack(channels, axis=-1)), 0, 255).astype(np.uint8)


def test_images_are_processed_on_the_models_gpu_as_on_the_host():
    """A torchvision-backend image processor (Qwen2-VL's) set to the GPU returns its pixels there, within a few
    levels of 255 of the host's (both resize with antialiasing), and the same grid. The processor around it is
    only its holder here (a real one needs a tokenizer from the hub)."""
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLImageProcessor

    from vgraph_compile.hf.server import images_on_device

    host, gpu = Qwen2VLImageProcessor(), Qwen2VLImageProcessor()
    assert not images_on_device(SimpleNamespace(image_processor=gpu), torch.device("cpu"))
    assert images_on_device(SimpleNamespace(image_processor=gpu), torch.device("cuda"))
    images = [_smooth_image(height, width, seed) for seed, (height, width) in enumerate(((480, 640), (333, 251)))]
    on_gpu, on_host = gpu(images=images, return_tensors="pt"), host(images=images, return_tensors="pt")
    assert on_gpu["pixel_values"].device.type == "cuda"
    assert torch.equal(on_gpu["image_grid_thw"].cpu(), on_host["image_grid_thw"])
    level = 1 / 255 / min(host.image_std)
    torch.testing.assert_close(on_gpu["pixel_values"].cpu(), on_host["pixel_values"], atol=4 * level, rtol=0)
