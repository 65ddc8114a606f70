"""Singleflight over a shared store: the first rank to need a key computes it once.

For every key the store holds at most these entries::

    v/<key>          the published value
    d/<key>          "done": a small marker set after the value, so that a rank that
                     already holds the value can learn it is published without fetching it
    c/<key>/<gen>    claim number <gen>: who is computing it (created atomically)
    h/<key>/<gen>    the claimant's heartbeat (a counter it bumps every lease/4)
    a/<key>/<gen>    "abandoned": the claimant finished without publishing
    w/<key>/<gen>/<n>  the claimant's signals (what waiters block on): "beat" at its n-th
                     heartbeat; once at the end "value:" + the value itself (up to
                     ``INLINE_VALUE_BYTES``), "published" (a larger value: read v/) or
                     "abandoned"; "moved" when claim <gen + 1> took it over
    n/<key>/<mark>   a mark set once (:meth:`Singleflight.first_to_mark`): the first
                     process to set it learns so; its setter may free it (``unmark``)
    j/<job>          the liveness key of a job whose processes hold claims
                     (``coordinator.protocol.liveness``)

A claim's record names its claimant and the claimant's job. Where the store expires keys
(Redis), a claim and its heartbeat, signals and marker live a few leases past the
claimant's last heartbeat (``coordinator.protocol.claims``); values live as the store keeps
them.

:meth:`Singleflight.lookup` returns the value if it is published. Otherwise it
tries to create claim 0; the rank that succeeds gets ``None`` back, computes the
value and calls :meth:`publish`. The others wait on the store (never inside a
collective) until one of four things happens:

* the value is published: they return it;
* the claimant marks the claim abandoned (Inductor bypassed the cache for that
  graph, or its compile failed): they return ``None`` and compute locally;
* the heartbeat stops moving for a whole lease (the claimant died), or the claim is of
  another job that has ended, or it is gone from the store: each tries to create claim
  ``gen + 1``; exactly one succeeds and computes, the others follow it;
* the configured deadline passes: they compute locally.

A claimant that cannot finish its claim (its compile failed, its publish failed, the store
refuses writes, the value is larger than the store can hold) releases it at once, best
effort, which ends its waiters' waits as an abandoned claim does.

The rooms of the protocol, from the top down (each uses only rooms below it)::

    singleflight   this process's view: the two sides below, and the store's health
    lookups        taking and following claims (lookup, offer, follow)
    publishing     writing a claimed value, in front of or behind the compile, and the marks
    waiting        the one wait loop on a claimant's signals, and its judgement
    claims         the claims this process holds: taking one, and its end, whichever it is
                   (published, dropped, handed off, abandoned), and their heartbeat

How a lookup ended is an :class:`~coordinator.protocol.outcome.Outcome`.

Waiters wait on the claimant's next signal: they block on it where the store can (the
c10d store's ``wait``, Redis publish/subscribe) and ``signalled_waits`` is on, so an idle
waiter costs the store about one call per heartbeat; elsewhere (the directory store) they
poll its slot. There is one wait loop, and one judgement of lease, deadline and progress.
The last signal says how the claim ended and, for a value of up to ``INLINE_VALUE_BYTES``,
carries the value: a woken waiter returns it without another store call. It is written
right after ``v/<key>``, before anything else the publish does.
A waiter judges a lapsed lease at a random point of the lease's first tenth
beyond it, and whoever takes the claim over signals "moved" on the old claim: the
waiters of a dead claimant follow the taker at once instead of all timing out together.
Waiters log a progress line after ``progress_interval`` of waiting and then less and less
often (``coordinator.protocol.waiting``), naming the claimant and what it computes, as its
claim's record says. Liveness is judged by each
waiter's own monotonic clock watching the heartbeat change, so no clock
synchronization between hosts is needed.

A value that fails its reader's verification (``coordinator.protocol.integrity``) is treated as
missing: :meth:`Singleflight.lookup` with ``rejected=`` that value claims the key again,
under a claim named after the key and the rejected value's digest
(``c/<key>/redo-<digest>/<gen>``, with its own heartbeats and signals), so that every rank
that read the same bad value meets at one claim: one compiles the value again and its
publish replaces the bad one, the others wait for it as for any claim.

A rank that already holds a key's value (a hit in its own local cache) calls
:meth:`Singleflight.offer` instead: if the store lacks the value and nobody is
computing it, it claims the key and publishes its copy; if another rank is computing
it, it waits like any waiter (so a warm rank waits on the store while a cold rank
compiles, rather than in the first collective).

Waits cannot form a cycle, because a rank holds a claim only inside a *leaf step*:
a step that finishes without waiting on any other rank. The two steps that claim
are a graph's compile (it claims its FX-graph key; a compile runs no collective) and
a Triton kernel's tuning at its first launch (it claims the kernel's autotune key;
the holder benchmarks configs on its own device). A rank that holds a claim never
waits for another key: its lookups inside the step are non-blocking. So every wait
points at a rank inside a leaf step, which ends (publishes, abandons, or dies and
loses its lease) without waiting itself. One kind of key is waited for even by a rank
that holds claims: a *leaf key*, whose owner computes it with no lookup at all (a
Triton kernel's compile, ``_compat.CacheKind.leaf``). Its owner ends it without waiting
on anything, so a wait for it ends, and no cycle passes through it (a rank tuning a
Triton kernel outside Inductor holds the kernel's autotune key and waits for configs
that other ranks compile: ``coordinator.features.triton_kernels``). Keys whose value can depend on other ranks
(AOTAutograd entries, published after a backward that may follow forward-pass
collectives; PGO profiles) are never waited on, only read. The checks of a claim's job
and of the claim's existence (``coordinator.protocol.waiting``) only end waits early, into
the takeover a lapsed lease leads to: they add no wait, and the argument above still holds.

A store failure costs compile time, never the job (``coordinator.protocol.health``): a
store that fails is left alone for a backoff (1 s, doubling to 30 s), during which every
lookup returns ``None`` at once and nothing is written, then tried again; when it answers,
sharing resumes. A store that refuses writes (``StoreFull``) is still read from: a lookup
returns a published value, and waits for a claim another process holds, but claims
nothing, and nothing is published, until its own backoff has passed. A value larger than
the store can hold (:meth:`Store.capacity`) is never sent; that is said once, with the
size and the limit.

A rank that waits may do work of its own first: ``lookup``'s ``before_waiting`` is
called until it has nothing left (``coordinator.features.early_backward``: backward graphs this
rank already knows). Such work runs with :meth:`Singleflight.no_waits`: inside it every
lookup returns at once, so the work waits on nothing and the argument above still holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta

from coordinator.errors import StoreError
from coordinator.observe.trace import NO_EVENTS, NoEvents
from coordinator.protocol.claims import ABANDONED, BEAT, INLINE_VALUE_BYTES, MOVED, PUBLISHED, VALUE, Claims, Owner
from coordinator.protocol.health import StoreHealth
from coordinator.protocol.liveness import JobLiveness
from coordinator.protocol.lookups import LookupResult, Lookups
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.publishing import Publisher
from coordinator.protocol.stores.base import Store
from coordinator.protocol.waiting import Waiter
from coordinator.protocol.writer import BackgroundWriter

__all__ = ["ABANDONED", "BEAT", "INLINE_VALUE_BYTES", "MOVED", "PUBLISHED", "VALUE", "LookupResult", "Outcome",
           "Owner", "Singleflight"]


class Singleflight:
    """Claims, heartbeats and waits for one process against one store: the taking and
    following side (:class:`~coordinator.protocol.lookups.Lookups`) and the publishing side
    (:class:`~coordinator.protocol.publishing.Publisher`) over one set of held claims."""

    def __init__(
        self,
        store: Store,
        *,
        owner: Owner,
        lease: timedelta,
        wait_timeout: timedelta,
        progress_interval: timedelta,
        signalled_waits: bool = True,
        events: NoEvents = NO_EVENTS,
        describe: Callable[[str], str] | None = None,
        writer: BackgroundWriter | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self.owner = owner
        #: Whether the store may be asked now, and written (``coordinator.protocol.health``).
        self.health = StoreHealth(store.name, events)
        lease_s = lease.total_seconds()
        self._liveness = JobLiveness(store, owner.job, lease_s)
        self._claims = Claims(store, owner, lease_s, self._liveness, on_error=self.health.failed,
                              on_success=self.health.answered, on_written=self.health.wrote,
                              reachable=self.health.reachable)
        waiter = Waiter(store, lease_s=lease_s, wait_timeout_s=wait_timeout.total_seconds(),
                        progress_interval_s=progress_interval.total_seconds(), signalled_waits=signalled_waits,
                        liveness=self._liveness)
        self._lookups = Lookups(store, self._claims, waiter, self.health, events, describe)
        self._publisher = Publisher(store, self._claims, self.health, writer)
        if signalled_waits:
            try:
                store.prepare_watch()
            except StoreError as exc:
                self.health.failed(exc)

    # -- state -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the store may be asked now (it answers, or its backoff has passed)."""
        return self.health.reachable()

    @property
    def job(self) -> str:
        """The job this process's claims name (``liveness.this_job``)."""
        return self.owner.job

    @property
    def writer(self) -> BackgroundWriter | None:
        """Where :meth:`publish_behind` writes run (``None``: in the caller's thread)."""
        return self._publisher.writer

    def claim_started(self, key: str) -> float | None:
        """Wall-clock time this process claimed ``key``, or ``None`` if it holds no claim."""
        return self._claims.started(key)

    def holds_claims(self) -> bool:
        """Whether this process holds claims (it is inside a leaf step): it does not wait."""
        return self._claims.any()

    def no_waits(self) -> contextlib.AbstractContextManager[None]:
        """On this thread, for the duration, lookups claim or return at once: a key
        another process holds is ``nonblocking`` instead of waited for."""
        return self._lookups.no_waits()

    # -- taking and following claims -----------------------------------------------------

    def lookup(self, key: str, *, blocking: bool, before_waiting: Callable[[], bool] | None = None,
               rejected: bytes | None = None, what: str | None = None, leaf: bool = False) -> LookupResult:
        """Find ``key``'s value; see the module docstring for what happens on a miss.
        Before a wait, ``before_waiting`` (if given) is called until it returns False
        or the value is published. ``rejected``: a value of ``key`` the caller refused,
        which counts as missing (one rank claims the key again, the others wait).
        ``what``: what this process computes for ``key``, for a claim's record (default:
        ``describe(key)``). ``leaf``: the key's owner computes it with no lookup of its
        own, so this process waits for it even while it holds claims."""
        return self._lookups.lookup(key, blocking=blocking, before_waiting=before_waiting, rejected=rejected,
                                    what=what, leaf=leaf)

    def follow(self, key: str, *, grace_s: float = 0.0) -> LookupResult:
        """Wait for ``key``'s value while another process holds a claim on it, never
        claiming it (``coordinator.features.split_shares``: slots only their owners claim).

        Outcomes: ``hit`` or ``waited`` with the value; ``unclaimed`` (nobody claimed it
        within ``grace_s``); ``abandoned``; ``expired`` (the claimant's lease lapsed; it is
        not taken over); ``deadline``; ``nonblocking`` (this process holds claims, or
        waits nowhere now); ``unavailable``.
        """
        return self._lookups.follow(key, grace_s=grace_s)

    def offer(self, key: str, what: str | None = None) -> LookupResult:
        """For a value this process already holds: make sure the store gets it, or wait
        for the rank computing it.

        Never fetches the value. Outcomes: ``hit`` (the store has it), ``claimed`` (the
        caller must :meth:`publish` its copy now, or :meth:`abandon`), ``waited`` (another
        rank was computing it and published), ``abandoned``/``deadline`` (that rank gave
        up, or the wait hit the deadline), ``nonblocking`` (this process holds claims, so
        it does not wait), ``unavailable``.
        """
        return self._lookups.offer(key, what)

    # -- publishing and abandoning -------------------------------------------------------

    def publish(self, key: str, value: bytes) -> bool:
        """Store ``key``'s value and release this process's claim on it.

        The value is written first, then the end signal (carrying a small value), then
        the "done" marker, then the claim's own keys are deleted: a woken waiter finds
        everything it reads already written. A value that is not written (the store is
        down or refuses writes, or the value is larger than the store can hold) releases
        the claim instead.

        Returns:
            Whether the value is in the store (else it stays local).
        """
        return self._publisher.publish(key, value)

    def publish_behind(self, key: str, value: Callable[[], bytes], *, nbytes: int, what: str,
                       published: Callable[[bool, bytes], None] | None = None) -> bool:
        """Publish ``key``'s value behind the caller: ``value()`` (which may seal and copy
        it) and :meth:`publish` run in the writer, in the order given, and then
        ``published(ok, value)``. The claim on ``key`` is handed off meanwhile: it ends
        without waiting on anything, so this process may wait on other claims while it is
        written. Its waiters keep waiting, on its heartbeat, until it is published.

        Returns:
            False if the writer refused it (its queue is full): the claim is abandoned at
            once, and the waiters compile.
        """
        return self._publisher.publish_behind(key, value, nbytes=nbytes, what=what, published=published)

    def abandon(self, key: str, *, publishing: bool = False) -> None:
        """Tell waiters that this process will not publish ``key``. A claim whose value is
        being written behind the compile is left to that write unless ``publishing``."""
        self._claims.abandon(key, publishing=publishing)

    def abandon_all(self, only: Callable[[str], bool] = lambda key: True) -> int:
        """Abandon every claim (of a key ``only`` accepts) whose value is still being
        computed (a compile ended without publishing them); claims being written behind
        the compile stay.

        Returns:
            How many claims were abandoned.
        """
        return self._publisher.abandon_all(only)

    def drain(self, timeout: timedelta) -> bool:
        """Let the writes behind the compile finish, up to ``timeout``; whether all did."""
        return self._publisher.drain(timeout)

    def first_to_mark(self, key: str, mark: str | int, *, ttl: timedelta | None = None) -> bool:
        """Set the once-only mark ``n/<key>/<mark>``: whether this process set it first.
        ``ttl``: how long the mark lives, where the store expires keys.

        Raises:
            StoreError: the store failed (the caller decides; the next publish or lookup
                finds the store failed and records it).
        """
        return self._publisher.first_to_mark(key, mark, ttl=ttl)

    def unmark(self, key: str, mark: str | int) -> None:
        """Delete the mark ``n/<key>/<mark>``, so that the next :meth:`first_to_mark` sets it.

        Raises:
            StoreError: the store failed.
        """
        self._publisher.unmark(key, mark)

    def close(self) -> None:
        """Stop the writer (what it has not written is lost), abandon the claims still held,
        stop the heartbeat thread, and delete this job's liveness key if this process wrote it."""
        self._publisher.close()
        self._claims.heartbeat.stop()
        if self.health.reachable():
            self._liveness.end()
