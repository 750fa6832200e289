#!/usr/bin/env bash
# Replicas of `kvmem serve` behind HAProxy, sharing PostgreSQL (memories, heat), Redis (tasks, fences) and one
# data dir (KV items), all on 127.0.0.1:
#   scripts/cluster.sh up --replicas 3 [--dir D] [-- <kvmem serve flags, e.g. --no-auth --backend fake>]
#   scripts/cluster.sh status [--dir D]
#   scripts/cluster.sh down [--dir D]
# `up` prints each replica, PostgreSQL and Redis, and the router's URL as its last line; `down` stops them all
# (the memories stay in D, default .kvmem-cluster). Needs haproxy, redis-server and postgresql (Debian
# packages: apt-get install haproxy redis-server postgresql). Run scripts/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/cluster.py "$@"
