#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv in .venv, torch (the 2.13.0 CPU build unless a GPU is
# present), this package with its dev extras, and the default model provisioned into ~/.cache/kvmem.
# Safe to run twice: every step checks before it works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch" >&2
    "${PIP[@]}" install "torch>=2.4"
  else
    echo "setup: no GPU, installing the torch 2.13.0 CPU build" >&2
    "${PIP[@]}" install "torch==2.13.0"
  fi
fi
if [ ! -f "$VENV/.kvmem-installed" ] || [ pyproject.toml -nt "$VENV/.kvmem-installed" ]; then
  echo "setup: installing kvmem and its dependencies" >&2
  "${PIP[@]}" install -e ".[dev]"
  touch "$VENV/.kvmem-installed"
fi
"$VENV/bin/python" -c "from kvmem.models import provision; print('setup: default model at', provision())" >&2
"$VENV/bin/python" -c "from kvmem.text.embed import minilm_model_dir; print('setup: embedder at', minilm_model_dir())" >&2
