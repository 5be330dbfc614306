#!/usr/bin/env bash
# Create .venv (seeing any torch already installed system-wide), add torch 2.13.0 only when none is importable,
# and install vgraph_compile with its test extras, the GPU install's kernels on a CUDA machine (the cuda or cuda13
# extra, by torch's CUDA), and any extras named as arguments (cudnn, fa4, fa4-cu13, flashinfer, serve) over that
# torch, pinned: an extra that needs another torch fails instead of replacing it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
# On a CUDA machine, the GPU install: the cuda extra, or cuda13 for torch built for CUDA 13.
gpu_extra=$(.venv/bin/python -c "import torch
cuda = torch.version.cuda
print('' if cuda is None or not torch.cuda.is_available() else 'cuda13' if cuda.startswith('13') else 'cuda')")
extras=$(IFS=,; echo "test${gpu_extra:+,$gpu_extra}${*:+,$*}")
.venv/bin/python -m pip install -q -e ".[$extras]" --constraint <(echo "torch==$torch_version")
