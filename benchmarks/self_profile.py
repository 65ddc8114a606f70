"""A rank process sampling itself with py-spy (``--profile-ranks`` of the runners): the jobs'
side, imported by ``cold_start_job.py`` and ``model_suite_job.py`` as a sibling module."""

from __future__ import annotations

import os
import time
from pathlib import Path


def start_self_profile(path: str):
    """py-spy on this process only (all its threads, idle time included), until
    :func:`stop_self_profile`. Unlike ``cold_start.py --profile``, which samples every
    process of the job, compile workers included, it leaves the rest of the host alone.
    ``--nonblocking``: py-spy reads the stacks without pausing the process (a rare sample
    may mix two moments). Pausing a max-autotune rank, some 30 threads, 50 times a second
    pushed one run past its device call's time limit; its cost was not separated from the
    machine's (step 1: 485.6 s paused, 454.0 s not, 364.2 s unprofiled, on three H200s)."""
    import ctypes
    import subprocess

    # py-spy is our child, and Yama's ptrace scope 1 lets a process trace only its
    # descendants: allow any tracer for this process (PR_SET_PTRACER, PR_SET_PTRACER_ANY).
    ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--idle", "--threads", "--format", "raw",
           "--nonblocking", "--rate", "50", "--output", path]
    # py-spy writes its samples only when it stops: where a time limit will end the run
    # (runs.sh sets COLD_START_PROFILE_UNTIL), stop it before, so the samples survive.
    until = os.environ.get("COLD_START_PROFILE_UNTIL")
    if until:
        cmd += ["--duration", str(max(1, int(until) - int(time.time())))]
    with open(path + ".log", "w") as messages:  # a file, not a pipe: a full pipe would stall py-spy
        proc = subprocess.Popen(cmd, stdout=messages, stderr=subprocess.STDOUT)
    time.sleep(1.0)  # py-spy attaches
    if proc.poll() is not None:
        log_tail = Path(path + '.log').read_text()[-2000:]
        raise SystemExit(f"py-spy could not sample rank process {os.getpid()}: {log_tail}")
    return proc


def stop_self_profile(proc) -> None:
    """Stop the sampler; it writes its file on SIGINT."""
    import signal

    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
