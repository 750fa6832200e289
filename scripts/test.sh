#!/usr/bin/env bash
# The test command: set up (idempotent), then run the suite with progress by file.
#
#   bash scripts/test.sh          the default suite: every test but real-model training, the real-model tests
#                                 (slow) included, on one pytest-xdist worker per core (two here), then the
#                                 few that must run in one process (-m serial: schemathesis's fuzzing)
#   bash scripts/test.sh --all    the same, then the training stage (-m train: LoRA distillation on the real
#                                 model, minutes of it) on its own; CI runs exactly this (.ci/run)
#
# Other arguments go to pytest and replace the default selection, run in one process: e.g.
# `bash scripts/test.sh -m "not slow"` (no real-model tests) or `bash scripts/test.sh tests/serving/engine`.
# KVMEM_TEST_WORKERS=1 runs the default suite in one process too (no xdist). Each stage prints how many tests it collected first and a line per file as it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ALL=0
ARGS=()
for arg in "$@"; do
  if [ "$arg" = --all ]; then ALL=1; else ARGS+=("$arg"); fi
done
WORKERS="${KVMEM_TEST_WORKERS:-$(nproc)}"
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
  # a file's tests share one worker (and its module fixtures); -v: a line per test, as workers interleave files
  PARALLEL=(-n "$WORKERS" --dist loadfile -v)
fi
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
STARTED=$SECONDS
if [ "${#ARGS[@]}" -gt 0 ]; then  # your own selection: one process, a line per file
  "${PYTEST[@]}" "${ARGS[@]}"
  exit
fi
echo "test: stage 1, the default suite (-m 'not train'): $WORKERS workers, then the serial tests" >&2
if [ "$WORKERS" -gt 1 ]; then
  "${PYTEST[@]}" "${PARALLEL[@]}" -m "not train and not serial"
  "${PYTEST[@]}" -m "serial and not train"
else
  "${PYTEST[@]}" -m "not train"
fi
echo "test: stage 1 took $(( SECONDS - STARTED )) s" >&2
if [ "$ALL" = 1 ]; then
  echo "test: stage 2, real-model training (-m train)" >&2
  STAGE=$SECONDS
  "${PYTEST[@]}" -m train
  echo "test: stage 2 took $(( SECONDS - STAGE )) s; both stages $(( SECONDS - STARTED )) s" >&2
fi
