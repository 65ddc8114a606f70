#!/usr/bin/env bash
# One device call's worth of GPU measurements on the 2 x H200 host, logs and results in $OUT.
#   bash benchmarks/gpu/runs.sh tier [ARGS]  # the GPU test tier (tests/gpu/run.sh; ARGS go to pytest)
#   bash benchmarks/gpu/runs.sh user      # a user's own script (benchmarks/user_script.py): $SCRIPT (default
#                                            # user_scripts/user_llama_ddp.py) with $SCRIPT_ARGS, N=$RANKS (default 2),
#                                            # rows $ROWS (default stock ours cm; the cm row through $CM_WRAPPER, default
#                                            # the script's own user_scripts/compile_once_wrapper.py), $PAIRS alternating
#                                            # pairs (default 2), UNTIL=K stops each job after step K; JOB_ENV="--env V=1";
#                                            # RESTART=1: each row's cold job, then the pairs are restarts (stock on its
#                                            # dirs, ours from its file:// store on empty ones)
#   bash benchmarks/gpu/runs.sh triton    # Triton kernels outside Inductor (user_scripts/triton_ddp.py): MODEL=fla (default)
#                                            # or liger, N=$RANKS (default 2), rows stock ours, each row's cold job then a
#                                            # restart pair (RESTART= turns the restarts off); carry the libraries' wheels (below)
#   bash benchmarks/gpu/runs.sh n2        # cold start, N=2 (NCCL), rows $ROWS (default a d e c f)
#   bash benchmarks/gpu/runs.sh n8        # cold start, N=8 emulated on 2 GPUs (gloo), rows $ROWS (default a d e);
#                                            # JOB_LOGS=<dir> keeps each job's output (COLD_START_LOG_LEVEL=DEBUG: coordinator lines)
#   bash benchmarks/gpu/runs.sh large     # cold start, N=$RANKS (default 2), the 12-layer GPT (d=768, T=512), rows $ROWS
#                                            # (default a d e); LARGE_REFS=<results json> reuses its references;
#                                            # MODE=max-autotune-no-cudagraphs compiles in that mode
#   bash benchmarks/gpu/runs.sh profile8  # N=8 emulated, rows d e under py-spy: where the leader's time goes
#   bash benchmarks/gpu/runs.sh repeated  # kernels repeated in a later graph (one GPU is enough, ~80 s): the 12-layer
#                                            # GPT with coordinate descent, N=2 emulated, row d at DEBUG; prints the
#                                            # follower's autotune misses and Triton compiles (want 0) and the leader's
#                                            # "shared the cached config" lines (want about 10)
#   ROWS=a bash benchmarks/gpu/runs.sh profile1  # one GPU, N=1, the 4-layer GPT in max-autotune-no-cudagraphs, row
#                                            # $ROWS (a: one rank alone; d: compile_once) with each rank sampling its own
#                                            # process (py-spy; carry its wheel: see below); then ROWS=d in the next call and
#                                            # here: profile_summary.py A.json D.json --profiles DIR (the samples, untarred)
#   bash benchmarks/gpu/runs.sh restart   # restarts (benchmarks/restart.py): models $MODELS (default llama phi3), the
#                                            # 142M size, N=$RANKS (default 1; a GPU per rank over NCCL where there are
#                                            # enough); PROFILE=1 adds a cProfile of both restarts ($LABEL-prof.tgz);
#                                            # BYPASS=1: ours' cold job leaves the split graphs out of the store;
#                                            # PAIRS=2: two restart pairs, stock, ours, ours, stock; VARIANTS="A=1 B=0":
#                                            # after each of ours' restarts, one with each variable set;
#                                            # PERSIST="moto file": also restarts from the persistent layer (a moto S3
#                                            # server on this machine, then a file:// dir) and from a bundle in the first,
#                                            # with the bundle's save and restore times (needs moto and s3fs: see below)
#   bash benchmarks/gpu/runs.sh split-cold  # cold starts, stock against ours (benchmarks/model_suite.py --split): models
#                                            # $MODELS (default llama phi3), the 142M size ($SIZE), N=$RANKS (default 4),
#                                            # $REPEAT pairs (default 1) alternating from $ORDER (stock-first or ours-first): steps,
#                                            # AOTAutograd misses, shares and price per frame; ours' traces and reports in
#                                            # the job logs; PROFILE_RANKS=1: each rank samples its own process
#                                            # (py-spy, carried in .whl) until its steps end, in $OUT/$LABEL-samples.tgz
#   bash benchmarks/gpu/runs.sh mac       # cold start, N=$RANKS (default 2), the 4-layer GPT in max-autotune-no-cudagraphs,
#                                            # rows $ROWS (default a d e); its own references unless MAC_REFS=<results json>;
#                                            # JOB_LOGS as for n8; PROFILE_RANKS=1: each rank samples its own
#                                            # process (as in profile1), samples in $OUT/$LABEL-samples.tgz
# ROWS=none measures only the one-rank references (saved to benchmarks/results/$LABEL.json, for
# MAC_REFS/LARGE_REFS in a later call). n2/n8 reuse the committed references; REFS= (empty)
# measures them again on this machine.
# moto and s3fs (PERSIST) are not on the GPU host: python3 -m pip download --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
# --platform any -d .whl "moto[s3]" flask flask-cors s3fs (41 wheels, 34 MB), and carry .whl; the restart step installs them.
# py-spy is not on the GPU host: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_5_x86_64 -d .whl py-spy (0.4.3 checked), and carry .whl.
# Every step first installs the project as users do: carry .whl holding the project's wheel
# (python3 -m pip wheel --no-deps -w .whl .) and the dependencies the GPU host lacks (redis-py:
# ../shared/wheels/device-cp312/, or python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 -d .whl redis); see benchmarks/gpu/install.sh.
# Each step stops at BUDGET_S seconds (default 570), so that one device call (10 minutes at
# most) returns what it measured; cold_start.py saves its table after every run, and a rank's
# py-spy stops 20 s before then, writing its samples. Every step leaves $OUT/machine.txt (host,
# GPU UUIDs: which calls ran on one machine) and $OUT/vmstat.log (load, CPU steal, every 5 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
# The project as users install it: the wheel and its dependencies (benchmarks/gpu/install.sh), no
# checkout on the path (the runners start every job in a directory of its own).
bash benchmarks/gpu/install.sh 2>&1 | tee "$OUT/install.log"; [ "${PIPESTATUS[0]}" = 0 ] || exit 1
export COORDINATOR_WHEEL_INSTALLED=1
START=$SECONDS
left() { echo $(( ${BUDGET_S:-570} - (SECONDS - START) )); }
# A rank sampling itself (--profile-ranks) stops py-spy at this time, so its samples are written
# even when the step's timeout ends the run.
export COLD_START_PROFILE_UNTIL=$(( $(date +%s) + ${BUDGET_S:-570} - 20 ))
{ hostname; cat /etc/machine-id 2>/dev/null; nvidia-smi -L; date -u; } > "$OUT/machine.txt" 2>&1
if command -v vmstat >/dev/null; then vmstat -t 5; else
  while :; do echo "$(date +%T) $(cat /proc/loadavg) $(head -1 /proc/stat)"; sleep 5; done; fi > "$OUT/vmstat.log" 2>&1 &
MONITOR=$!
trap 'kill $MONITOR 2>/dev/null' EXIT
SMALL="--dim 512 --seq 256 --layers 4"
LARGE="--dim 768 --seq 512 --layers 12"
REFS=${REFS-benchmarks/results/gpu-small-default-references.json}

case "${1:?tier | user | worker-redis | n2 | n8 | large | profile8 | profile1 | mac | repeated | restart | split-cold}" in
  worker-redis)
    # Where the compile workers' Triton jobs look for Redis, the user script at N=2, each job stopped
    # after step 1 (benchmarks/tools/watch_workers.py reads the workers' /proc/PID/environ): first the
    # wheel in .whl/old (an earlier commit) with its defaults, TORCHINDUCTOR_REDIS_URL set, and
    # TORCH_WARM_POOL=0; then this wheel, with and without the early pool, under a listener on
    # 127.0.0.1:6379 that counts every connection (none wanted).
    label=${LABEL:-gpu-worker-redis}
    rm -rf "/tmp/jl-$label"
    args=(--ranks 2 --until-step 1 --env HF_LOG=1 --job-logs "/tmp/jl-$label" --results-dir "$OUT" --out "$OUT/$label.md")
    script=benchmarks/user_scripts/user_llama_ddp.py
    python3 -m pip install -q --no-index --no-deps --force-reinstall --no-cache-dir .whl/old/*.whl
    python3 benchmarks/tools/watch_workers.py --out "$OUT/$label-old-workers.json" & watcher=$!
    timeout "$(left)" python3 benchmarks/user_script.py "${args[@]}" --label "$label-old" --pairs 1 --rows ours \
      ours-url:TORCHINDUCTOR_REDIS_URL=coordinator-no-remote-cache-in-compile-workers:// ours-nopool:TORCH_WARM_POOL=0 \
      -- $script 2>&1 | tee "$OUT/$label-old.log"
    kill $watcher; wait $watcher
    python3 -m pip install -q --no-index --no-deps --force-reinstall --no-cache-dir .whl/torch_compile_coordinator-*.whl
    python3 benchmarks/tools/watch_workers.py --listen 6379 --out "$OUT/$label-new-workers.json" & watcher=$!
    timeout "$(left)" python3 benchmarks/user_script.py "${args[@]}" --label "$label-new" --pairs "${PAIRS:-2}" \
      --rows ours ours-nowarm:COORDINATOR_WARM_COMPILE_POOL=0 -- $script 2>&1 | tee "$OUT/$label-new.log"
    kill $watcher; wait $watcher
    tar czf "$OUT/$label-job-logs.tgz" -C "/tmp/jl-$label" .
    ;;
  user)
    label=${LABEL:-gpu-user-llama-n${RANKS:-2}}
    rm -rf "/tmp/jl-$label"
    timeout "$(left)" python3 benchmarks/user_script.py --label "$label" --ranks ${RANKS:-2} --pairs ${PAIRS:-2} \
      --rows ${ROWS:-stock ours cm} --cm-wrapper "${CM_WRAPPER:-benchmarks/user_scripts/compile_once_wrapper.py}" \
      ${UNTIL:+--until-step $UNTIL} ${RESTART:+--restart} --env HF_LOG=1 ${JOB_ENV:-} --job-logs "/tmp/jl-$label" --results-dir "$OUT" \
      --out "$OUT/$label.md" -- ${SCRIPT:-benchmarks/user_scripts/user_llama_ddp.py} ${SCRIPT_ARGS:-} 2>&1 \
      | tee "$OUT/$label.log"
    tar czf "$OUT/$label-job-logs.tgz" -C "/tmp/jl-$label" .
    ;;
  triton)
    # Triton kernels outside Inductor: the user step on user_scripts/triton_ddp.py (MODEL=fla or liger), stock
    # and ours, RESTART=1 by default (each row's cold job, then a restart pair). Carry the libraries' wheels:
    #   python3 -m pip download --no-deps -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0 liger-kernel==0.8.5 einops
    python3 -m pip install -q --no-index --no-deps --find-links .whl fla-core flash-linear-attention liger-kernel \
      einops 2>&1 | tail -2
    python3 -c "import fla, liger_kernel, transformers, triton; print('fla', fla.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__)"
    label=${LABEL:-gpu-triton-${MODEL:-fla}-n${RANKS:-2}}
    rm -rf "/tmp/jl-$label"
    timeout "$(left)" python3 benchmarks/user_script.py --label "$label" --ranks ${RANKS:-2} --pairs ${PAIRS:-1} \
      --rows ${ROWS:-stock ours} ${RESTART---restart} ${UNTIL:+--until-step $UNTIL} --env HF_LOG=1 ${JOB_ENV:-} \
      --job-logs "/tmp/jl-$label" \
      --results-dir "$OUT" --out "$OUT/$label.md" -- benchmarks/user_scripts/triton_ddp.py --model ${MODEL:-fla} 2>&1 \
      | tee "$OUT/$label.log"
    tar czf "$OUT/$label-job-logs.tgz" -C "/tmp/jl-$label" .
    ;;
  split-cold)
    label=${LABEL:-gpu-split-cold-n${RANKS:-4}}
    rm -rf "/tmp/jl-$label" "/tmp/samples-$label"
    if [ -n "${PROFILE_RANKS:-}" ] && ! command -v py-spy >/dev/null; then
      python3 -m pip install -q --no-index --find-links .whl py-spy 2>&1 | tail -2
    fi
    timeout "$(left)" python3 benchmarks/model_suite.py --split --label "$label" --models ${MODELS:-llama phi3} \
      --size ${SIZE:-restart} --ranks ${RANKS:-4} --order ${ORDER:-stock-first} --repeat ${REPEAT:-1} --gpu --trace \
      ${PROFILE_RANKS:+--profile-ranks "/tmp/samples-$label"} \
      --job-logs "/tmp/jl-$label" --results-dir "$OUT" --out "$OUT/$label.md" 2>&1 | tee "$OUT/$label.log"
    tar czf "$OUT/$label-job-logs.tgz" -C "/tmp/jl-$label" .
    if [ -n "${PROFILE_RANKS:-}" ]; then tar czf "$OUT/$label-samples.tgz" -C "/tmp/samples-$label" .; fi
    ;;
  restart)
    label=${LABEL:-gpu-restart-n${RANKS:-1}}
    rm -rf "/tmp/jl-$label" /tmp/restart-prof
    if [ -n "${PERSIST:-}" ] && ! python3 -c "import moto.server, flask_cors, s3fs" 2>/dev/null; then
      python3 -m pip install -q --no-index --find-links .whl "moto[s3]" flask flask-cors s3fs 2>&1 | tail -3
    fi
    timeout "$(left)" python3 benchmarks/restart.py --label "$label" --models ${MODELS:-llama phi3} --size restart \
      --ranks ${RANKS:-1} --gpu ${PROFILE:+--profile-restarts /tmp/restart-prof} ${BYPASS:+--bypass-split-graphs} \
      ${PERSIST:+--persist $PERSIST} ${PAIRS:+--pairs $PAIRS} ${VARIANTS:+$(printf -- "--variant %s " $VARIANTS)}--job-logs "/tmp/jl-$label" --results-dir "$OUT" --out "$OUT/$label.md" 2>&1 \
      | tee "$OUT/$label.log"
    tar czf "$OUT/$label-job-logs.tgz" -C "/tmp/jl-$label" .
    if [ -n "${PROFILE:-}" ]; then tar czf "$OUT/$label-prof.tgz" -C /tmp/restart-prof .; fi
    ;;
  tier)
    shift  # what follows the step goes to pytest (-k ...)
    OUT=$OUT timeout "$(left)" bash tests/gpu/run.sh "$@"
    ;;
  n2)
    label=${LABEL:-gpu-small-n2}
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 2 --ranks 2 --repeat "${REPEAT:-3}" \
      --rows ${ROWS:-a d e c f} ${REFS:+--references "$REFS"} --out "$OUT/$label.md" -- $SMALL 2>&1 | tee "$OUT/$label.log"
    cp "benchmarks/results/$label.json" "$OUT/"
    ;;
  n8)
    label=${LABEL:-gpu-small-n8}
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 2 --ranks 8 --repeat "${REPEAT:-3}" \
      --rows ${ROWS:-a d e} ${REFS:+--references "$REFS"} ${JOB_LOGS:+--job-logs "$JOB_LOGS"} --out "$OUT/$label.md" \
      -- $SMALL 2>&1 | tee "$OUT/$label.log"
    cp "benchmarks/results/$label.json" "$OUT/"
    if [ -n "${JOB_LOGS:-}" ]; then tar czf "$OUT/$label-job-logs.tgz" -C "$JOB_LOGS" .; fi
    ;;
  large)
    label=${LABEL:-gpu-large${MODE:+-mac}-n${RANKS:-2}}
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 2 --ranks "${RANKS:-2}" --repeat "${REPEAT:-3}" \
      --rows ${ROWS:-a d e} ${LARGE_REFS:+--references "$LARGE_REFS"} --out "$OUT/$label.md" -- $LARGE ${MODE:+--mode "$MODE"} 2>&1 | tee "$OUT/$label.log"
    cp "benchmarks/results/$label.json" "$OUT/"
    ;;
  mac)
    label=${LABEL:-gpu-small-mac-n${RANKS:-2}}
    if [ -n "${PROFILE_RANKS:-}" ]; then
      command -v py-spy >/dev/null || { echo "py-spy missing: see the top of this script"; exit 1; }
      rm -rf /tmp/profile-ranks
    fi
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 2 --ranks "${RANKS:-2}" --repeat "${REPEAT:-3}" \
      --rows ${ROWS:-a d e} ${MAC_REFS:+--references "$MAC_REFS"} ${JOB_LOGS:+--job-logs "$JOB_LOGS"} \
      ${PROFILE_RANKS:+--profile-ranks /tmp/profile-ranks} --out "$OUT/$label.md" \
      -- $SMALL --mode max-autotune-no-cudagraphs 2>&1 | tee "$OUT/$label.log"
    cp "benchmarks/results/$label.json" "$OUT/"
    if [ -n "${JOB_LOGS:-}" ]; then tar czf "$OUT/$label-job-logs.tgz" -C "$JOB_LOGS" .; fi
    if [ -n "${PROFILE_RANKS:-}" ]; then tar czf "$OUT/$label-samples.tgz" -C /tmp/profile-ranks .; fi
    ;;
  repeated)
    label=${LABEL:-gpu1-large-coordesc-n2}
    rm -rf /tmp/jl-repeated
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 COLD_START_LOG_LEVEL=DEBUG timeout "$(left)" python3 benchmarks/cold_start.py \
      --label "$label" --gpus 1 --ranks 2 --repeat 1 --rows d --references benchmarks/results/gpu-large-n2.json \
      --job-logs /tmp/jl-repeated --out "$OUT/$label.md" -- $LARGE 2>&1 | tee "$OUT/$label.log"
    cp "benchmarks/results/$label.json" "$OUT/"
    tar czf "$OUT/$label-job-logs.tgz" -C /tmp/jl-repeated .
    python3 - "benchmarks/results/$label.json" <<'PY' | tee -a "$OUT/$label.log"
import json, sys
run = json.load(open(sys.argv[1]))["rows"][0]["runs"][0]
for r in run["ranks"]:
    role = "leader" if r["fx_misses"] else "follower"
    print(role, "rank", r["rank"], "FX compiles", r["fx_misses"], "Triton compiles", r["triton_compiles"],
          "autotune", r["stats"]["by_cache"].get("autotune"))
PY
    echo "leader lines 'shared the cached config': $(cat /tmp/jl-repeated/*.log | grep -c 'shared the cached config')" | tee -a "$OUT/$label.log"
    ;;
  profile1)
    command -v py-spy >/dev/null || { echo "py-spy missing: see the top of this script"; exit 1; }
    label=${LABEL:-gpu1-small-mac-profile-${ROWS:-a}}
    rm -rf /tmp/profile-ranks
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 1 --ranks 1 --repeat 1 --rows ${ROWS:-a} \
      --references "${MAC_REFS:-benchmarks/results/gpu-small-mac-refs10.json}" --profile-ranks /tmp/profile-ranks \
      --out "$OUT/$label.md" -- $SMALL --mode max-autotune-no-cudagraphs 2>&1 | tee "$OUT/$label.log"
    python3 benchmarks/tools/profile_summary.py "benchmarks/results/$label.json" --detail "coordinator's own" \
      --triton-stages --detail Inductor | tee "$OUT/$label-phases.md"
    cp "benchmarks/results/$label.json" "$OUT/"
    tar czf "$OUT/$label-samples.tgz" -C /tmp/profile-ranks .
    ;;
  profile8)
    label=${LABEL:-gpu-small-n8-profile}
    timeout "$(left)" python3 benchmarks/cold_start.py --label "$label" --gpus 2 --ranks 8 --repeat "${REPEAT:-2}" \
      --rows ${ROWS:-d e} ${REFS:+--references "$REFS"} --profile "${PROFILE_DIR:-/tmp/profiles}" --out "$OUT/$label.md" \
      -- $SMALL 2>&1 | tee "$OUT/$label.log"
    python3 benchmarks/tools/profile_summary.py "benchmarks/results/$label.json" | tee "$OUT/$label-phases.md"
    cp "benchmarks/results/$label.json" "$OUT/"
    ;;
esac
