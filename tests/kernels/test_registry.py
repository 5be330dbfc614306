"""The kernel registry: every kernel's name written once, resolved to a kernel that can run here or refused with
the fix (an unknown name, a missing optional package, an unsupported device or dtype, a head dim too wide)."""

import importlib
import importlib.util
from typing import get_args

import pytest
import torch

from vgraph_compile.config import VGraphConfig
from vgraph_compile.kernels import registry


def test_every_backend_name_is_an_accepted_name_and_names_its_kernel():
    """``AttentionBackendName`` is made from ``BACKENDS``; each name is the module ``load`` imports, unless the
    kernel names the module it shares (the dense kernels), and that module defines its function."""
    assert get_args(registry.AttentionBackendName) == ("default", *registry.BACKENDS)
    for name, backend in registry.BACKENDS.items():
        assert backend.name == name
        module = importlib.import_module(f"vgraph_compile.kernels.{backend.module or name}")
        assert callable(getattr(module, backend.function, None)), name


@pytest.mark.parametrize("name", ["sdpa", "flex", "qkv_offsets_reference"])
def test_cpu_kernels_load_their_modules_attention(name):
    module = importlib.import_module(f"vgraph_compile.kernels.{name}")
    assert registry.BACKENDS[name].load() is module.attention
    assert registry.resolve(name, torch.device("cpu"), torch.float32) is registry.BACKENDS[name]


def test_auto_times_neither_the_reference_nor_flex():
    untimed = {name for name, backend in registry.BACKENDS.items() if not backend.timed_by_auto}
    assert untimed == {"sdpa", "flex"}


def test_resolve_rejects_unknown_and_unsupported_backends():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        registry.resolve("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="'torch_varlen' cannot run on cpu"):
        registry.resolve("torch_varlen", torch.device("cpu"), torch.bfloat16)
    assert registry.resolve("default", torch.device("cpu"), torch.bfloat16).name == "sdpa"


@pytest.mark.parametrize(
    "name, module, package",
    [
        ("cudnn", "cudnn", "nvidia-cudnn-frontend"),
        ("flashinfer", "flashinfer", "flashinfer-python"),
        ("fa4", "flash_attn", "flash-attn-4"),
    ],
)
def test_missing_optional_kernel_names_its_pip_package(name, module, package):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(ValueError, match=f"needs the optional package {package}: pip install {package}"):
        registry.resolve(name, torch.device("cuda"), torch.bfloat16)


def test_cudnn_backend_is_registered_and_validates_head_dim():
    """``cudnn`` is a config-level kernel name; a head dim cuDNN cannot take is padded to one it can, or refused
    with the fix."""
    assert "cudnn" in registry.BACKENDS and "cudnn" in get_args(registry.AttentionBackendName)
    assert VGraphConfig(attention_backend="cudnn").attention_backend == "cudnn"
    backend = registry.BACKENDS["cudnn"]
    assert (backend.padded_head_dim(72), backend.padded_head_dim(70)) == (72, 72)  # the op pads 70 to 72
    with pytest.raises(ValueError, match="'cudnn' runs head_dim up to 128, got 136: choose another"):
        backend.padded_head_dim(136)


def test_head_dims_refuse_wider_heads_and_packed_kernels():
    backend = registry.AttentionBackend("narrow", lambda d, t: True, head_dims=(64, 80, 128))
    assert [backend.padded_head_dim(d) for d in (40, 72, 80, 96)] == [64, 80, 80, 128]
    with pytest.raises(ValueError, match="'narrow' runs head_dim up to 128, got 256: choose another"):
        backend.padded_head_dim(256)
    with pytest.raises(ValueError, match="packed kernel cannot declare head_dims"):
        registry.AttentionBackend("p", lambda d, t: True, qkv_offsets=True, head_dims=(64,))


def test_installed_packages_name_every_optional_kernel_package_with_its_version_or_none(monkeypatch):
    """A saved plan's key holds these, so installing a kernel package changes it."""
    from importlib import metadata

    packages = {backend.package[1] for backend in registry.BACKENDS.values() if backend.package is not None}
    assert set(registry.installed_packages()) == packages and "flash-attn-4" in packages
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "4.0.0" if name == "flash-attn-4" else real(name))
    assert registry.installed_packages()["flash-attn-4"] == "4.0.0"
