#!/usr/bin/env bash
# The many-users engine arm (benchmarks/gpu/many_users_gpu.py, no peer) at several commits on one machine: which
# commit moved it. The trees are the commits' code, put in .gpu/trees/<sha> beforehand by
# `TREES="sha ..." bash benchmarks/gpu/gpu_bundle.sh` (a lent machine has no git history); this tree runs first
# and last, so the order's effect shows beside the commits'.
#
#   bash benchmarks/gpu/many_users_bisect.sh OUT_DIR [many_users_gpu args...]   # what gpu_suite.sh's step runs
#
# TREES_DIR: where the trees are (default .gpu/trees). Writes OUT_DIR/many_users_bisect_<sha>.json (this tree
# without its eager warm-up: ..._<sha>_no_eager_warm.json; its last run: ..._<sha>_again.json). Found on
# 2026-11-30: the engine arm ran at 163 and 182 tokens/s at 2322adf and 99542a4 against 328 at b25932c in the
# same call (benchmarks/results/gpu/h200/README.md, calls 11-13).
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
PY=$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")
[[ "$PY" == /* ]] || PY=$PWD/$PY
head=${KVMEM_GIT_SHA:-head}
status=0
# this tree also without its eager-step warm-up (serving/engine/warm.py): the reading of 2026-11-30 is that the
# regression is the first burst setting up the masked attention kernel, which the warm-up now does at load
runs=(". $head $head" ". $head ${head}_no_eager_warm --no-eager-warm")
for tree in "${TREES_DIR:-.gpu/trees}"/*/; do
  [ -d "$tree" ] && runs+=("$tree $(basename "$tree") $(basename "$tree")")
done
runs+=(". $head ${head}_again")
for r in "${runs[@]}"; do
  read -r tree sha name extra <<<"$r"
  echo "[many_users_bisect] $sha ($tree) ${extra:-}" >&2
  # shellcheck disable=SC2086 # extra: zero or one flag
  (cd "$tree" && KVMEM_GIT_SHA=$sha PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m benchmarks.gpu.many_users_gpu --no-peer $extra "$@" --out "$out/many_users_bisect_$name.json" \
    | tail -3 | head -1) || status=1
done
exit $status
