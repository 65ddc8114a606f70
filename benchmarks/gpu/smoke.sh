#!/usr/bin/env bash
# compile_once on one host with 2 GPUs (NCCL): plain torchrun (ranks on cuda:0 and cuda:1),
# torchrun --virtual-local-rank (every rank on cuda:0), and every rank compiling alone.
# Run on the GPU host from the repo root; logs go to $OUT (or ./gpu-logs).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ARGS="--dim 512 --seq 256 --layers 4 --steps 3"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))" | tee "$OUT/versions.txt"
run() { name=$1; shift; echo "=== $name: $*"; TMPDIR=$(mktemp -d) torchrun --standalone --nproc-per-node 2 "$@" 2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*" | tee "$OUT/$name.log" | grep -E "^ +[0-9]|all |compile_once rank|WARNING|Error|cuda:" ; }
run alone examples/train.py $ARGS --no-coordinator
run plain examples/train.py $ARGS
run virtual --virtual-local-rank examples/train.py $ARGS
