#!/usr/bin/env bash
# What a lent GPU machine needs beside the working tree to run benchmarks/gpu/gpu_suite.sh, in one folder, .gpu/
# (git-ignored through .git/info/exclude; ~30 MB). Such a machine has torch, transformers and peft but no
# network, and lacks our server's and benchmark client's packages; it cannot provision the default model.
#
#   bash benchmarks/gpu/gpu_bundle.sh            # on this machine, after scripts/setup.sh
#   TREES="b25932c 5fcd399" bash benchmarks/gpu/gpu_bundle.sh   # also those commits' code (many_users_bisect.sh)
#
# Puts in .gpu/: wheels for CPython 3.12 x86-64 of fastapi, starlette, uvicorn, pydantic (+ core), openai (the
# client http_load uses), xgrammar (structured outputs; graphs_test runs its mask on CUDA), transformers (the
# version CI tests, over the image's older one) and their missing dependencies, at the versions of .venv; the default model's tokenizer
# (gpu_model.py then writes random weights of its shape); the default embedder's ONNX file and tokenizer.
# Prints the command to run there last (the device tool: carry [".gpu"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
B=.gpu
mkdir -p "$B/whl" "$B/minilm"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types typing_extensions \
  anyio openai httpx2 httpcore2 truststore jiter sniffio xgrammar apache-tvm-ffi transformers; do
  pins+=("$name==$(version "$name")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$B/whl" "${pins[@]}"
"$PY" - <<'EOF'
from transformers import AutoTokenizer

from kvmem.models import provision

AutoTokenizer.from_pretrained(str(provision())).save_pretrained(".gpu/tokenizer")
EOF
"$PY" - <<'EOF'
import shutil

from kvmem.text.search.embedders import minilm_model_dir, minilm_onnx_path

shutil.copy(minilm_model_dir() / "tokenizer.json", ".gpu/minilm/tokenizer.json")
shutil.copy(minilm_onnx_path(), ".gpu/minilm/model.onnx")
EOF
# TREES="sha ...": those commits' code into .gpu/trees/<sha>, for benchmarks/gpu/many_users_bisect.sh
rm -rf "$B/trees"
for t in ${TREES:-}; do
  mkdir -p "$B/trees/$t"
  git archive "$t" serving kvmem benchmarks/__init__.py benchmarks/common.py benchmarks/gpu benchmarks/ttft \
    benchmarks/engine | tar x -C "$B/trees/$t"
done
du -sh "$B" >&2
sha=$(git rev-parse --short HEAD)
cat <<EOF
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site || exit 3; export KVMEM_GIT_SHA=$sha KVMEM_TOKENIZER_DIR=\$PWD/.gpu/tokenizer KVMEM_MINILM_DIR=\$PWD/.gpu/minilm KVMEM_MINILM_ONNX=\$PWD/.gpu/minilm/model.onnx HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 PYTHON=python3 BUDGET_S=480 PACK=\$OUT/gpu.tgz KVMEM_CACHE_DIR=/tmp/kvcache; bash benchmarks/gpu/gpu_suite.sh /tmp/gpu 2>&1 | tee \$OUT/suite.log
EOF
