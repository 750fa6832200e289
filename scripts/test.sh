#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite, slow real-model tests included.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
