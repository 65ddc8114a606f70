#!/bin/sh
# SLURM Prolog: restore the persisted compile bundle into this node's Inductor cache dir
# before the job's tasks start. slurm.conf: Prolog=/etc/slurm/coordinator/prolog.sh
#
# Site settings come from coordinator.env beside this script (COORDINATOR_PYTHON, the
# python that has coordinator installed; COORDINATOR_RESTORE_BUNDLE, ...); see
# launch/slurm/README.md. Jobs add theirs with --comment "coordinator.bundle=NAME".
# Always exits 0: a failing prolog would drain the node and requeue the job.
here=$(cd "$(dirname "$0")" && pwd)
hook=${COORDINATOR_HOOK:-prolog}
if [ -r "$here/coordinator.env" ]; then
    set -a; . "$here/coordinator.env"; set +a
fi
PATH=${PATH:-/usr/local/bin:/usr/bin:/bin}
export PATH
log=${COORDINATOR_SLURM_LOG:-/dev/null}
"${COORDINATOR_PYTHON:-python3}" -m coordinator.cli slurm "$hook" >>"$log" 2>&1 \
    || echo "coordinator slurm $hook: could not run ${COORDINATOR_PYTHON:-python3} (exit $?)" >>"$log"
exit 0
