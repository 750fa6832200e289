#!/usr/bin/env bash
# The GPU figures of the engine in one run (issue 26), at most ~8 minutes on one H100 with only torch,
# transformers and peft installed (no vLLM, no network). Writes every JSON (git sha inside) under one folder.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]          # default OUT_DIR: benchmarks/results/gpu
#
# Env: PYTHON (default: .venv/bin/python if present, else python3); DEVICE (default cuda; cpu for a smoke run);
# KVMEM_TOKENIZER_DIR: the default model's tokenizer files, for a machine that cannot provision the default
# model (it then runs random weights of its shape: benchmarks/gpu_model.py); SMOKE=1: tiny sizes (a check of
# the script itself on CPU, not figures).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
start=$(date +%s)
failed=()
step() {  # step NAME SECONDS CMD...: run with a time limit; a failure is recorded and the suite goes on
  local name=$1 limit=$2
  shift 2
  echo "[gpu_suite +$(($(date +%s) - start))s] $name" >&2
  if ! timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    failed+=("$name")
    tail -5 "$OUT/$name.log" >&2
  fi
}
if [ "${SMOKE:-0}" = 1 ]; then
  EX=(--sizes 200 --queries 20 --new-tokens 4); GRID=(--ctx 300 --query 40 --reps 1)
  QWEN=(); ENG=(--block-tokens 300 --requests 4 --tokens 4 --pool-mb 256); LOAD=(--levels 1 2 --duration-s 5)
else
  EX=(--sizes 500 2000 6000 --queries 20 150 950); GRID=(--quick)
  QWEN=(--random-preset qwen3-8b --reps 3)  # the MemOS cells (benchmarks/anchors)
  ENG=(--block-tokens 2000 --requests 32 --tokens 32 --pool-mb 4096); LOAD=(--levels 1 8 32 --duration-s 20)
fi
MODEL="$OUT/model"
step model 120 "$PY" -m benchmarks.gpu_model --out "$MODEL"
step exactness_fp32 90 "$PY" -m benchmarks.exactness --model "$MODEL" --device "$DEVICE" --dtype float32 "${EX[@]}" --out "$OUT/exactness_fp32.json"
step exactness_bf16 60 "$PY" -m benchmarks.exactness --model "$MODEL" --device "$DEVICE" --dtype bfloat16 "${EX[@]}" --out "$OUT/exactness_bf16.json"
step engine 120 "$PY" -m benchmarks.engine_bench --model "$MODEL" --device "$DEVICE" "${ENG[@]}" --out "$OUT/engine_bench.json"
step ttft_default 60 "$PY" -m benchmarks.ttft_grid --model "$MODEL" --device "$DEVICE" "${GRID[@]}" --out "$OUT/ttft_default.json"
if [ "$DEVICE" = cuda ]; then  # graphs: the compiled model (torch.compile, CUDA graphs for its decode shapes)
  step ttft_default_compiled 90 "$PY" -m benchmarks.ttft_grid --model "$MODEL" --device cuda --compile "${GRID[@]}" --out "$OUT/ttft_default_compiled.json"
  step ttft_qwen3_8b 120 "$PY" -m benchmarks.ttft_grid "${QWEN[@]}" --device cuda --out "$OUT/ttft_qwen3_8b.json"
fi
step http_load 150 "$PY" -m benchmarks.http_load --spawn --model "$MODEL" "${LOAD[@]}" --serve-args "--device $DEVICE" --out "$OUT/http_load.json"
echo "[gpu_suite] done in $(($(date +%s) - start)) s; results in $OUT; failed: ${failed[*]:-none}" >&2
[ ${#failed[@]} -eq 0 ]
