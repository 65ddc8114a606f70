"""Which job a process belongs to, and whether a job whose claims a waiter meets still runs.

A claim names its job (:func:`this_job`): torchrun's run id and restart count where set,
else an id the job's ranks agree on through the default process group's store, else an id
of this process alone. A waiter that meets a claim of *another* job asks whether that job
still runs (:meth:`JobLiveness.gone`), so that the claims a finished or killed job left in
a store shared across jobs do not hold a later job for a lease each.

Each job has a liveness key ``j/<digest of the job id>``. A process writes it before it
creates a claim (so a waiter that finds the claim finds the key) and every eighth of a
lease while it holds claims (its heartbeat thread, ``coordinator.protocol.claims``), and
deletes it when it closes. What the key says depends on the store:

* Redis expires keys: the key lives a quarter lease past its last write, so it is gone a
  quarter lease after the last process of the job that held claims stopped (killed, or its
  heartbeat stalled), or at once after a normal exit. A waiter on another job's claim
  reads it when the wait begins and again whenever an eighth of a lease passes without a
  signal.
* The directory store keeps keys until they are deleted: the key is gone after a normal
  exit, not after a kill. A waiter on another job's claim whose lease lapses while the key
  did not change either (no process of that job beat meanwhile) records that job as gone
  and deletes its key: each later claim of that job, in any process and any later job,
  is taken over at once, so a killed job costs one lease in all, not one per key.
* The job's TCPStore dies with the job, and no other job reads it; a TCPStore shared on
  purpose behaves as the directory store.

A process that closes deletes the key while another process of its job may still hold
claims; that one writes it again at its next heartbeat, and a waiter of another job that
reads the key in between takes a live claim over: a graph compiled twice, never a wait.

A claim of a job that is gone is stale: the waiter takes it over (the next generation), as
after a lapsed lease, whether the claim was abandoned or not. A claim of this process's own
job, or of a job that runs, is judged as before (heartbeat and lease). An abandoned claim of
a job that runs means what it means inside a job: compile locally.

No wait cycle can come of this: the check only ends a wait earlier, into the takeover a
lapsed lease already leads to; the key is written by the claimant and its heartbeat thread,
which wait for nothing; and a waiter that takes a claim over is inside a leaf step like any
claimant (``coordinator.protocol.singleflight``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

import msgpack

from coordinator.errors import StoreError
from coordinator.protocol.stores.base import Store

log = logging.getLogger(__name__)

#: This process's own job id, for a process that belongs to no job it can name.
PROCESS_JOB = f"process-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def job_id() -> str:
    """An id every rank of this job (and of this restart of it) shares: torchrun's run id
    and restart count, else one agreed through the default process group's store, else
    empty."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"{run}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    from coordinator import _compat

    store = _compat.default_c10d_store()
    if store is None:
        return ""
    return store.compare_set("coordinator/job_id", "", uuid.uuid4().hex).decode()


def this_job() -> str:
    """The job a claim of this process names: :func:`job_id`, else this process's own id."""
    try:
        return job_id() or PROCESS_JOB
    except Exception as exc:  # the job's store failed: the claims name this process
        log.debug("no job id from the job's store (%s); claims name this process", exc)
        return PROCESS_JOB


def liveness_key(job: str) -> str:
    return f"j/{hashlib.sha256(job.encode()).hexdigest()[:24]}"


class JobLiveness:
    """This process's writes of its job's liveness key, and its judgement of other jobs'."""

    def __init__(self, store: Store, job: str, lease_s: float) -> None:
        self.store = store
        self.job = job
        self.lease = lease_s
        #: Where keys expire, the key lives a quarter lease past its last write (every lease/8).
        self.ttl = timedelta(seconds=lease_s / 4) if store.expires else None
        self._beats = 0
        self._written_at: float | None = None
        self._gone: set[str] = set()
        self._lock = threading.Lock()

    def beat(self, *, unless_fresh: bool = False) -> None:
        """Write this job's key (a counter, so that a waiter can see it move). With
        ``unless_fresh``, skip it if this process wrote it less than a heartbeat ago."""
        now = time.monotonic()
        with self._lock:
            if unless_fresh and self._written_at is not None and now - self._written_at < self.lease / 8:
                return
            self._beats += 1
            beats = self._beats
        self.store.set(liveness_key(self.job), msgpack.packb([beats, time.time()]), ttl=self.ttl)
        with self._lock:
            self._written_at = now

    def seen(self, job: str) -> bytes | None:
        """What ``job``'s key holds now (``None``: gone)."""
        if job in self._gone:
            return None
        return self.store.get(liveness_key(job))

    def is_other(self, job: str) -> bool:
        """Whether ``job`` names another job than this process's (an old claim names none)."""
        return bool(job) and job != self.job

    def gone(self, job: str) -> bool:
        """Whether ``job`` (another job) has stopped: no liveness key."""
        return self.seen(job) is None

    def lapsed(self, job: str, seen_at_start: bytes | None) -> None:
        """A claim of ``job`` lapsed its lease while ``job``'s key stayed ``seen_at_start``:
        no process of that job beat for a lease. Record it as gone, here and in the store."""
        if seen_at_start is None or self.store.get(liveness_key(job)) != seen_at_start:
            return
        self._gone.add(job)
        try:
            self.store.delete(liveness_key(job))
        except StoreError as exc:
            log.debug("could not delete the liveness key of job %s: %s", job, exc)
        log.info("job %s holds claims but has beaten no heartbeat for a lease: its claims are taken over at once",
                 job)

    def end(self) -> None:
        """This process closes: delete its job's key if it wrote it (best effort)."""
        if self._written_at is None:
            return
        try:
            self.store.delete(liveness_key(self.job))
        except StoreError as exc:
            log.debug("could not delete this job's liveness key: %s", exc)
