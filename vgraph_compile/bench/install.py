"""Which install a benchmark ran on, by what is importable, and the versions of what it ran with.

The plain install (``pip install vgraph-compile``) has torch's own attention kernels; the GPU install adds the
fastest attention kernels that install from wheels: FlashAttention-4 (``flash_attn.cute``, from ``flash-attn-4``
on ``nvidia-cutlass-dsl``) and cuDNN's attention (``cudnn``, from ``nvidia-cudnn-frontend``). A number names its
install, so every report records this.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import re
from typing import Any

import torch

__all__ = ["GPU_INSTALL_MODULES", "PACKAGES", "Install", "device_record", "install"]

GPU_INSTALL_MODULES = {"flash_attn.cute": "flash-attn-4", "cudnn": "nvidia-cudnn-frontend"}
"""Module -> the package that brings it: the GPU install's attention kernels."""
PACKAGES = ("torch", "transformers", "triton", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend")
"""The packages whose versions a report records (None: not installed)."""

Install = dict[str, Any]


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported (its parent package is imported to find it; any failure there: no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _version(package: str) -> str | None:
    if package == "torch":
        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def install() -> Install:
    """``{"install": "GPU install" | "plain" | "partial: ...", "tag": "cuda" | "plain" | "partial", "importable":
    {module: bool}, "versions": {package: version or None}}``: the GPU install when every module of
    ``GPU_INSTALL_MODULES`` imports, plain when none does."""
    importable = {module: _importable(module) for module in GPU_INSTALL_MODULES}
    if all(importable.values()):
        name, tag = "GPU install", "cuda"
    elif not any(importable.values()):
        name, tag = "plain", "plain"
    else:
        present = ", ".join(GPU_INSTALL_MODULES[module] for module, found in importable.items() if found)
        name, tag = f"partial: {present} only", "partial"
    return {
        "install": name,
        "tag": tag,
        "importable": importable,
        "versions": {package: _version(package) for package in PACKAGES},
    }


def device_record(device: str) -> dict[str, Any]:
    """``{"device": its name, "device_tag": its model ("h200", "h100", ...) or "cpu", "date": today}`` for ``device``
    ("cuda" or "cpu")."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name()
        model = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name)  # "NVIDIA H100 80GB HBM3" -> h100
        tag = (model.group(0) if model else name.split()[-1]).lower()
    else:
        name = tag = "cpu"
    return {"device": name, "device_tag": tag, "date": datetime.date.today().isoformat()}
