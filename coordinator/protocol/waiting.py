"""A singleflight waiter: the one wait loop on a claimant's signals, and the one judgement
of lease, deadline and progress (``coordinator.protocol.singleflight`` describes the protocol).

A waiting rank logs what a person can place: the claimant (rank, host, pid), what it
computes (the description its claim's record carries, ``coordinator.protocol.claims``:
the graph, its function, the split frame's part, Dynamo's compile id), how long this rank
has waited, and the key as the trace names it (one line; wrapped here)::

    waiting on rank 0 on node-a (pid 4242) for backward graph 1 of 'GPT.forward' (compile 0/0)
    (fx_graph/9f2c...): 30s so far, last heartbeat 2.1s ago

The lines back off: with ``progress_interval`` P (default 10 s) they come after P, 3P and
6P of waiting, then every 6P (10 s, 30 s, 60 s, then every minute), counted from the start
of the lookup, so that a takeover does not start the series again.

Besides the claimant's signals, a waiter looks at the store itself when no signal came
for a while (one request where the store reads several keys at once: the claim, the value,
the abandon marker): whether the claim still exists (a claimant whose store refuses writes deletes
its claim to release it, and its signals may not have been kept), every quarter lease where
it polls and every third where keys expire (Redis; a timed-out c10d wait is costly, and
that store refuses no writes); and on a claim of another job, also whether that job still
runs (``coordinator.protocol.liveness``), every eighth of a lease where keys expire. A claim
that is gone, or of a job that is gone, ends the wait as a lapsed lease does: the waiter
tries the next generation (where the claim was published and deleted, it finds the value).
So does a value announced as published that the store no longer holds (evicted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time

from coordinator.observe.trace import short_key
from coordinator.protocol.claims import ABANDONED, BEAT, MOVED, PUBLISHED, VALUE, Owner, beats_of, claim_record
from coordinator.protocol.liveness import JobLiveness
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.stores.base import PollingWatch, Store

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, eq=False)
class Waiter:
    """Waits of one process on the claims of others in one store."""

    store: Store = dataclasses.field(kw_only=False)
    lease_s: float
    wait_timeout_s: float
    progress_interval_s: float
    #: Block on the claimant's signals where the store can; False polls them.
    signalled_waits: bool
    liveness: JobLiveness | None = None

    def published(self, published: str, rejected: bytes | None) -> bytes | None:
        """Store key ``published``'s value, unless it is the ``rejected`` one."""
        value = self.store.get(published)
        return None if value is None or value == rejected else value

    def wait(self, at: str, gen: int, started: float, published: str,
             rejected: bytes | None = None) -> tuple[Outcome, bytes | None, int | None]:
        """Wait for the claimant's signals: ``w/<key>/<gen>/<n>`` is written at its n-th
        heartbeat ("beat") and once when the claim ends (the value itself, "published" or
        "abandoned"). On a store that can block (and with ``signalled_waits``), an idle
        waiter makes about one store call per heartbeat (lease/4), and the end signal is
        the last call of a wait; elsewhere it polls the next signal's slot. Returns the
        outcome, the value (if it came with the end signal) and the claimant's rank.
        ``at`` names the claim (the key, or its redo name)."""
        raw = self.store.get(f"c/{at}/{gen}")
        owner = Owner.of_claim(raw)
        if owner is None:  # ended since it was found: published (and deleted), or released
            value = self.published(published, rejected)
            return (Outcome.WAITED, value, None) if value is not None else (Outcome.EXPIRED, None, None)
        what = claim_record(raw).get("what")
        key = short_key(at.split("/redo-", 1)[0])  # a redo claim's key
        claimant = _Claimant(str(owner), f"{what or 'its key'} ({key})")
        other = owner.job if self.liveness is not None and self.liveness.is_other(owner.job) else None
        seen = self.liveness.seen(other) if other is not None else None
        if other is not None and seen is None:
            log.info("%s on %s belongs to job %s, which has ended; taking over", claimant.owner, claimant.what, other)
            return Outcome.EXPIRED, None, owner.rank
        ended, value = self._wait_on(at, gen, started, published, claimant, rejected, other, seen)
        return ended, value, owner.rank

    def progress_due(self, waited_s: float) -> float:
        """When the next progress line is due, in seconds of waiting, after ``waited_s``:
        the first of P, 3P, 6P, 12P, 18P, ... (P: ``progress_interval``) past it."""
        interval = self.progress_interval_s
        for multiple in (1, 3, 6):
            if waited_s < multiple * interval:
                return multiple * interval
        step = 6 * interval
        return (int(waited_s // step) + 1) * step

    def _judge(self, claimant: _Claimant, started: float, last_change: float, next_progress: float,
               now: float, lease: float) -> tuple[Outcome | None, float]:
        """How a wait that has seen no value ends now ("expired": no heartbeat for a lease;
        "deadline"), or ``None``; logs the progress line when due. Returns the outcome and
        when the next progress line is due."""
        if now - last_change > lease:
            log.warning("lease of %s on %s expired (no heartbeat for %.1fs); taking over",
                        claimant.owner, claimant.what, now - last_change)
            return Outcome.EXPIRED, next_progress
        if now - started > self.wait_timeout_s:
            log.warning("waited %.0fs on %s for %s, past the %.0fs deadline; compiling locally",
                        now - started, claimant.owner, claimant.what, self.wait_timeout_s)
            return Outcome.DEADLINE, next_progress
        if now >= next_progress:
            log.info("waiting on %s for %s: %s so far, last heartbeat %.1fs ago",
                     claimant.owner, claimant.what, _seconds(now - started), now - last_change)
            next_progress = started + self.progress_due(now - started)
        return None, next_progress

    def _wait_on(self, key: str, gen: int, started: float, published: str, claimant: _Claimant,
                 rejected: bytes | None, other: str | None = None,
                 seen: bytes | None = None) -> tuple[Outcome, bytes | None]:
        """``other``: the claimant's job, if it is another job (whose liveness key read
        ``seen`` when the wait began)."""
        beats = beats_of(self.store, key, gen)
        last_change = time.monotonic()
        next_progress = started + self.progress_due(last_change - started)
        check = True
        # Waiters of a dead claimant judge it at different moments: the first takes over
        # and signals "moved", which ends the others' waits before they time out.
        lease = self.lease_s * (1 + random.uniform(0, 0.1))
        watching = (self.store.watch(f"w/{key}/{gen}") if self.signalled_waits
                    else contextlib.nullcontext(PollingWatch(self.store)))
        with watching as watch:
            # Where it polls, the waiter also sees a claim deleted; on another job's claim,
            # where keys expire, that the job is gone (a blocking c10d wait never times out early).
            look_every = (self.lease_s / 8 if other is not None and self.store.expires
                          else self.lease_s / 4 if not watch.blocking
                          else self.lease_s / 3 if self.store.expires else None)
            looked = False
            while True:
                if check:
                    ended = self._look(key, gen, published, rejected, claimant, other, looked)
                    if ended is not None:
                        return ended
                    check = looked = False
                now = time.monotonic()
                outcome, next_progress = self._judge(claimant, started, last_change, next_progress, now, lease=lease)
                if outcome:
                    if outcome == Outcome.EXPIRED and other is not None:
                        self.liveness.lapsed(other, seen)
                    return outcome, None
                # No timeout for the progress line: a live claimant signals every lease/4,
                # and each signal brings the judgement round again. A timed-out c10d wait
                # is costly (TCPStore cancels it and logs a warning).
                timeout = min(last_change + lease, started + self.wait_timeout_s) - now
                looking = look_every is not None and timeout > look_every
                signal = watch.wait(f"w/{key}/{gen}/{beats + 1}",
                                    max(look_every if looking else timeout, 0.0) + 0.001)
                if signal is None:
                    check = looked = looking
                    continue
                beats += 1
                last_change = time.monotonic()
                ended = self._ended_by(signal, claimant, published, rejected)
                if ended is not None:
                    return ended
                # A signal this version does not know: read the store, as a poll would.
                check = signal != BEAT

    def _look(self, key: str, gen: int, published: str, rejected: bytes | None, claimant: _Claimant,
              other: str | None, looked: bool) -> tuple[Outcome, bytes | None] | None:
        """Read the store for how the wait ends (the value, the abandon marker, and with
        ``looked`` the claim itself and whether job ``other`` still runs), or ``None``."""
        # One request where the store reads several keys at once; else the claim
        # first: a claim deleted after its publish leaves the value to the next read.
        keys = [f"c/{key}/{gen}"] if looked else []
        *claim, value, abandoned = self.store.get_many([*keys, published, f"a/{key}/{gen}"])
        if value is not None and value != rejected:
            return Outcome.WAITED, value
        if abandoned is not None:
            return self._abandoned(claimant)
        if looked and claim[0] is None:
            log.info("%s released or lost its claim on %s; taking it over", claimant.owner, claimant.what)
            return Outcome.EXPIRED, None
        if looked and other is not None and self.liveness.gone(other):
            log.info("%s on %s belongs to job %s, which has ended; taking over", claimant.owner, claimant.what, other)
            return Outcome.EXPIRED, None
        return None

    def _ended_by(self, signal: bytes, claimant: _Claimant, published: str,
                  rejected: bytes | None) -> tuple[Outcome, bytes | None] | None:
        """How the claimant's ``signal`` ends the wait, or ``None`` (a beat, or a signal
        this version does not know)."""
        if signal.startswith(VALUE):
            return Outcome.WAITED, signal[len(VALUE):]
        if signal == ABANDONED:
            return self._abandoned(claimant)
        if signal == MOVED:
            log.info("the claim of %s on %s was taken over; following the new claimant",
                     claimant.owner, claimant.what)
            return Outcome.EXPIRED, None
        if signal == PUBLISHED and not published.startswith("v/"):
            return Outcome.WAITED, None  # an offer: the value is published, d/ follows it
        if signal == PUBLISHED:  # the value is in v/, written before the signal
            value = self.published(published, rejected)
            if value is not None:
                return Outcome.WAITED, value
            # Evicted (Redis at maxmemory) or replaced since: nobody will publish it now.
            log.info("%s published %s, but the store no longer holds it; taking it over",
                     claimant.owner, claimant.what)
            return Outcome.EXPIRED, None
        return None

    @staticmethod
    def _abandoned(claimant: _Claimant) -> tuple[Outcome, None]:
        log.info("%s gave up on %s without publishing; compiling locally", claimant.owner, claimant.what)
        return Outcome.ABANDONED, None


@dataclasses.dataclass(frozen=True, slots=True)
class _Claimant:
    """A claim's owner and what it computes, as the lines of a wait name them."""

    owner: str
    what: str


def _seconds(seconds: float) -> str:
    """A wait's length as its lines show it: tenths under 10 s, whole seconds above."""
    return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
