#!/bin/sh
# SLURM Epilog: publish the bundles the job left in the node's outbox, then (with
# COORDINATOR_SLURM_CLEAN=1) remove the node-local cache dir. slurm.conf:
# Epilog=/etc/slurm/coordinator/epilog.sh. Settings as for prolog.sh; always exits 0.
COORDINATOR_HOOK=epilog exec "$(dirname "$0")/prolog.sh"
