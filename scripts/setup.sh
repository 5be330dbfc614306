#!/usr/bin/env bash
# Create .venv (seeing any torch already installed system-wide), add torch 2.13.0 only when none is importable,
# and install vgraph_compile with its test extras and any extras named as arguments (cudnn, fa4, fa4-cu13,
# flashinfer, serve) over that torch, pinned: an extra that needs another torch fails instead of replacing it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
extras=$(IFS=,; echo "test${*:+,$*}")
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
.venv/bin/python -m pip install -q -e ".[$extras]" --constraint <(echo "torch==$torch_version")
