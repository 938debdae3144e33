#!/usr/bin/env bash
# Set up a virtual environment with poseidon_aio built and installed (editable) for development.
#
# torch: a torch the base interpreter already has is reused (the venv sees the system site
# packages); otherwise a machine with an NVIDIA GPU gets the default (CUDA) build, and a machine
# without one gets torch==2.13.0, whose CPU wheel lies in this workplace's local wheel store.
# Elsewhere, point POSEIDON_TORCH_INDEX at PyTorch's CPU wheel index to get the CPU build, or set
# POSEIDON_TORCH to any pip requirement (e.g. "torch==2.5.1") to choose it yourself.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the torch of $("$PYTHON" -c 'import sys; print(sys.executable)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${POSEIDON_TORCH:-}" ]; then
    spec=$POSEIDON_TORCH
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.1"
  else
    spec="torch==2.13.0"
  fi
  echo "setup: installing $spec"
  if [ -n "${POSEIDON_TORCH_INDEX:-}" ]; then
    "$PY" -m pip install --index-url "$POSEIDON_TORCH_INDEX" "$spec"
  else
    "$PY" -m pip install "$spec"
  fi
fi

"$PY" -m pip install -e ".[dev,examples]"
"$PY" -m poseidon_aio.cli info
