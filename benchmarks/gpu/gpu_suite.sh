#!/usr/bin/env bash
# The GPU figures of the engine in one run (issue 26), at most ~8 minutes on one H100 with torch, transformers
# and peft installed (no vLLM, no network). Writes every JSON (git sha inside) under one folder.
#
#   bash benchmarks/gpu/gpu_suite.sh [OUT_DIR]          # default OUT_DIR: benchmarks/results/gpu
#
# On a lent machine with no network, `bash benchmarks/gpu/gpu_bundle.sh` here first: it puts the server's and the
# client's wheels, the tokenizer and the embedder's files in .gpu/ and prints the command to run there.
# Runs of 2026-11-27: benchmarks/results/gpu/h100/ (eager) and h200/ (with CUDA graphs), a README.md in each.
#
# Env:
#   PYTHON     default .venv/bin/python if present, else python3
#   DEVICE     default cuda; cpu for a smoke run
#   KVMEM_TOKENIZER_DIR  the default model's tokenizer files, for a machine that cannot provision the default
#              model: it then runs seeded random weights of its shape (benchmarks/gpu/gpu_model.py --random)
#   SMOKE=1    tiny sizes (a check of the script itself on CPU, not figures)
#   BUDGET_S   wall-clock budget of the whole suite (default 480): a step's limit is cut to what is left, and
#              a step with under 20 s left is skipped (recorded as failed)
#   ONLY       space-separated step names to run (a rerun of the ones that failed); `model` always runs
#   PACK       a .tgz path, rewritten after every step with OUT_DIR's JSON and logs (not the model): what a
#              run cut short by its caller's limit still hands back
# Each step prints when it starts (with its limit) and how long it took. Steps run in order of what the issue
# asks first: the CUDA-graph tests (graphs_test), graph_tokens (greedy
# tokens of decode steps replayed as CUDA graphs against eager ones, float32 and bfloat16, with every reachable
# bucket captured at load as the server does; issue 42 item 8), engine (KV bytes,
# batch-8 vs batch-1 step, eager and as CUDA graphs), http_load with graphs and without, the MemOS cells on
# Qwen3-8B's shape, exactness, then ttft on the default model, eager and compiled (graphs change decode steps
# only, not a TTFT).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/gpu}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-480}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${KVMEM_GIT_SHA:-}" ]; then
  KVMEM_GIT_SHA=$(git rev-parse --short HEAD 2>/dev/null || true)
  export KVMEM_GIT_SHA
fi
mkdir -p "$OUT"
start=$(date +%s)
failed=()
pack() {
  [ -n "${PACK:-}" ] || return 0
  tar czf "$PACK.tmp" -C "$OUT" --exclude=./model . && mv "$PACK.tmp" "$PACK"
}
step() {  # step NAME SECONDS CMD...: run within min(SECONDS, what is left); a failure is recorded, the suite goes on
  local name=$1 limit=$2 left
  shift 2
  if [ -n "${ONLY:-}" ] && [ "$name" != model ] && [[ " $ONLY " != *" $name "* ]]; then
    return 0
  fi
  left=$((BUDGET_S - ($(date +%s) - start)))
  if [ "$left" -lt 20 ]; then
    echo "[gpu_suite +$(($(date +%s) - start))s] $name skipped: ${left}s of the budget left" >&2
    failed+=("$name(skipped)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "[gpu_suite +$(($(date +%s) - start))s] $name (limit ${limit}s)" >&2
  local began
  began=$(date +%s)
  if ! timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    failed+=("$name")
    tail -5 "$OUT/$name.log" >&2
  fi
  echo "[gpu_suite +$(($(date +%s) - start))s] $name took $(($(date +%s) - began))s" >&2
  pack
}
if [ "${SMOKE:-0}" = 1 ]; then
  EX=(--sizes 200 --queries 20 --new-tokens 4); GRID=(--ctx 300 --query 40 --reps 1)
  QWEN=(--ctx 300 --query 40 --reps 1); ENG=(--block-tokens 300 --requests 4 --tokens 4 --pool-mb 256)
  LOAD=(--levels 1 2 --duration-s 5); GT=(--smoke)
  PROF=(--rows 1 2 --chunks 16 --ctx 0 64 --reps 1 --profile-steps 1 --pool-mb 256)
  DP=(--tiny --rows 1 3 --prompt 20 --new-tokens 4); PG=(--cells 300x40 --reps 1 --pool-mb 256)
  MU=(--tiny --users 6 --requests 8 --system 8 --block 40 --query 10 --new-tokens 4 --max-running 4)
else
  EX=(--sizes 500 2000 6000 --queries 20 150 950); GRID=(--quick)
  QWEN=(--reps 3)  # the MemOS cells (benchmarks/anchors)
  ENG=(--block-tokens 2000 --requests 32 --tokens 32 --pool-mb 4096); LOAD=(--levels 1 8 32 --duration-s 20)
  GT=(); PROF=()
  DP=(--rows 1 8 32 64 --prompt 256 --new-tokens 64); PG=(--reps 3)  # PG: MemOS's nine cells
  MU=(--users 48 --requests 64 --block 1500 --new-tokens 16)  # ~12 GB of blocks' K/V, the pool an eighth
fi
MODEL="$OUT/model"
RANDOM_MODEL=()
[ -n "${KVMEM_TOKENIZER_DIR:-}" ] && RANDOM_MODEL=(--random)
step model 120 "$PY" -m benchmarks.gpu.gpu_model --out "$MODEL" "${RANDOM_MODEL[@]}"
if [ "$DEVICE" = cuda ]; then  # captured graphs give the eager engine's tokens, the fast layers a full prefill's (tiny models; pytest)
  step graphs_test 120 "$PY" -m pytest -q -p no:cacheprovider tests/serving/engine/test_graphs.py tests/serving/engine/test_prefill_graphs.py \
    tests/serving/engine/test_fast_layers.py::test_on_cuda_in_float32_the_fast_layers_give_the_generic_logits_and_a_full_prefills_tokens \
    tests/serving/engine/test_fast_layers.py::test_on_cuda_in_bfloat16_a_lone_chunk_takes_the_causal_form \
    tests/serving/engine/test_grammar_mask.py \
    --deselect tests/serving/engine/test_prefill_graphs.py::test_the_default_model_with_injected_kv_and_padded_prefill_equals_a_full_prefill
fi
# decode on Qwen3-8B's shape (random bf16 weights) at 1, 8, 32 and 64 requests through the engine and through
# transformers' continuous batching (generate_batch, paged|sdpa, CUDA graphs), same process, same card (issue 43
# item 5); each case with its floor (benchmarks/gpu/floor.py). Budget ~150 s of the 480 on an H100: the 16 GB
# model built once (~20 s), the peer's four runs with their graph warm-ups, the engine's four with theirs
step decode_qwen3_8b 150 "$PY" -m benchmarks.gpu.decode_peer --device "$DEVICE" "${DP[@]}" --out "$OUT/decode_qwen3_8b.json"
# graphs' and eager steps' greedy tokens, float32 and bfloat16 (on CPU: the script, with the static steps uncaptured)
step graph_tokens 150 "$PY" -m benchmarks.gpu.graph_tokens --model "$MODEL" --device "$DEVICE" "${GT[@]}" --out "$OUT/graph_tokens.json"
# engine_bench runs the decode steps eagerly and then as CUDA graphs (serving/engine/graphs.py) on a GPU
step engine 180 "$PY" -m benchmarks.engine.engine_bench --model "$MODEL" --device "$DEVICE" "${ENG[@]}" --out "$OUT/engine_bench.json"
# the server with CUDA graphs (its default on a GPU), then without, on the same machine
step http_load 150 "$PY" -m benchmarks.load.http_load --spawn --model "$MODEL" "${LOAD[@]}" --serve-args "--device $DEVICE" --out "$OUT/http_load.json"
step http_load_eager 150 "$PY" -m benchmarks.load.http_load --spawn --model "$MODEL" "${LOAD[@]}" --serve-args "--device $DEVICE --no-cuda-graphs" --out "$OUT/http_load_eager.json"
# where a step's time goes (issue 43): kernels or aten ops per layer, host and device time per step
step step_profile 90 "$PY" -m benchmarks.engine.step_profile --model "$MODEL" --device "$DEVICE" "${PROF[@]}" --out "$OUT/step_profile.json"
if [ "$DEVICE" = cuda ]; then  # Qwen3-8B's shape: 16 GB of bf16 weights, GPU only
  step step_profile_qwen3_8b 120 "$PY" -m benchmarks.engine.step_profile --random-preset qwen3-8b --dtype bfloat16 --device cuda "${PROF[@]}" --pool-mb 8192 --out "$OUT/step_profile_qwen3_8b.json"
  step ttft_qwen3_8b 120 "$PY" -m benchmarks.ttft.ttft_grid --random-preset qwen3-8b "${QWEN[@]}" --device cuda --out "$OUT/ttft_qwen3_8b.json"
  # a KV-injected request's query-only forward, eager vs replayed from a prefill CUDA graph (issue 43 item 3)
  step prefill_graphs_qwen3_8b 100 "$PY" -m benchmarks.engine.prefill_graphs_bench --random-preset qwen3-8b --dtype bfloat16 --device cuda "${PG[@]}" --pool-mb 8192 --out "$OUT/prefill_graphs_qwen3_8b.json"
fi
step exactness_fp32 90 "$PY" -m benchmarks.ttft.exactness --model "$MODEL" --device "$DEVICE" --dtype float32 "${EX[@]}" --out "$OUT/exactness_fp32.json"
step exactness_bf16 120 "$PY" -m benchmarks.ttft.exactness --model "$MODEL" --device "$DEVICE" --dtype bfloat16 "${EX[@]}" --out "$OUT/exactness_bf16.json"
step ttft_default 60 "$PY" -m benchmarks.ttft.ttft_grid --model "$MODEL" --device "$DEVICE" "${GRID[@]}" --out "$OUT/ttft_default.json"
step prefill_graphs 60 "$PY" -m benchmarks.engine.prefill_graphs_bench --model "$MODEL" --device "$DEVICE" "${PG[@]}" --out "$OUT/prefill_graphs.json"
# many users' memory blocks on Qwen3-8B's shape (random bf16 weights): the engine loading each from host memory
# into an eighth-sized page pool vs transformers' continuous batching re-prefilling the pasted blocks with prefix
# sharing on; TTFT p50/p90/p99, tokens/s, loads, the floor (issue 44 item 8). Sized for ~90 s on an H100 (not
# yet measured: the 16 GB model built, 48 blocks prefilled and pinned in host memory, both arms' graphs
# captured, 64 requests each); after the figures above, so a full run reaches it only when they leave room:
# ONLY=many_users_qwen3_8b runs it alone
step many_users_qwen3_8b 120 "$PY" -m benchmarks.gpu.many_users_gpu --device "$DEVICE" "${MU[@]}" --out "$OUT/many_users_qwen3_8b.json"
# its engine arm at this commit, here without the eager warm-up (serving/engine/warm.py), at each commit in
# .gpu/trees (gpu_bundle.sh's TREES), and here again: which commit moved it (2026-11-30: 2.0x slower at 2322adf
# than at b25932c on one machine), and whether the warm-up is the fix; ~40 s a run; ONLY=many_users_bisect
if compgen -G ".gpu/trees/*/" >/dev/null; then  # only when the bundle carries trees
  step many_users_bisect 420 bash benchmarks/gpu/many_users_bisect.sh "$OUT" --device "$DEVICE" "${MU[@]}"
fi
# the engine with its element-wise functions under torch.compile (issue 43 item 2: compiled functions or not,
# measured against the steps above; the compile time at start is in each JSON), no peer; inductor's cache outside
# OUT (not packed). Late in the order, so a pass with the whole budget reaches the figures above first:
# ONLY="decode_qwen3_8b_compiled prefill_graphs_qwen3_8b_compiled" runs them alone
step decode_qwen3_8b_compiled 150 "$PY" -m benchmarks.gpu.decode_peer --device "$DEVICE" "${DP[@]}" --no-peer --compile \
  --compile-cache /tmp/kvmem_inductor --out "$OUT/decode_qwen3_8b_compiled.json"
if [ "$DEVICE" = cuda ]; then
  step prefill_graphs_qwen3_8b_compiled 120 "$PY" -m benchmarks.engine.prefill_graphs_bench --random-preset qwen3-8b --dtype bfloat16 --device cuda "${PG[@]}" --pool-mb 8192 \
    --compile --compile-cache /tmp/kvmem_inductor --out "$OUT/prefill_graphs_qwen3_8b_compiled.json"
fi
# the torch.compile'd model (inductor; dynamic shapes, no CUDA graphs): its compile did not finish within 120 s
# on the H100 (2026-11-27), so it runs last, on what is left of the budget
if [ "$DEVICE" = cuda ]; then
  step ttft_default_compiled 180 "$PY" -m benchmarks.ttft.ttft_grid --model "$MODEL" --device cuda --compile "${GRID[@]}" --out "$OUT/ttft_default_compiled.json"
fi
echo "[gpu_suite] done in $(($(date +%s) - start)) s; results in $OUT; failed: ${failed[*]:-none}" >&2
echo "${failed[*]:-}" >"$OUT/failed.txt"
pack
[ ${#failed[@]} -eq 0 ]
