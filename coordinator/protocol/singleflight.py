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

The claims a process holds and their heartbeat are ``coordinator.protocol.claims``; the
wait is ``coordinator.protocol.waiting``; how a lookup ended is an
:class:`~coordinator.protocol.outcome.Outcome`.

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
loses its lease) without waiting itself. Keys whose value can depend on other ranks
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
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

from coordinator.errors import StoreError
from coordinator.observe.trace import NO_EVENTS, WAIT_ENDINGS, NoEvents, short_key
from coordinator.protocol.claims import (
    ABANDONED,
    BEAT,
    INLINE_VALUE_BYTES,
    MOVED,
    PUBLISHED,
    VALUE,
    Claim,
    Claims,
    Owner,
    latest_gen,
)
from coordinator.protocol.health import StoreHealth
from coordinator.protocol.liveness import JobLiveness
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.stores.base import Store
from coordinator.protocol.waiting import Waiter
from coordinator.protocol.writer import BackgroundWriter

log = logging.getLogger(__name__)

__all__ = ["ABANDONED", "BEAT", "INLINE_VALUE_BYTES", "MOVED", "PUBLISHED", "VALUE", "LookupResult", "Outcome",
           "Owner", "Singleflight"]


@dataclasses.dataclass(slots=True)
class LookupResult:
    """The outcome of a lookup: a value, or why there is none."""

    value: bytes | None
    outcome: Outcome
    waited_s: float = 0.0


class Singleflight:
    """Claims, heartbeats and waits for one process against one store."""

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
        #: ``describe(key)``: what this process computes for ``key``, in words, for the
        #: record of a claim it takes (``coordinator.protocol.claims``), unless the lookup
        #: says (``what=``).
        self._describe = describe
        #: Where :meth:`publish_behind` writes run (``None``: in the caller's thread).
        self.writer = writer
        self._told_full = False
        self.events = events
        #: Block on the claimant's signals (heartbeats, end, moved) where the store can;
        #: False polls them.
        self.signalled_waits = signalled_waits
        self.owner = owner
        self.lease = lease.total_seconds()
        self.wait_timeout = wait_timeout.total_seconds()
        self.progress_interval = progress_interval.total_seconds()
        #: Whether the store may be asked now, and written (``coordinator.protocol.health``).
        self.health = StoreHealth(store.name, events)
        self._liveness = JobLiveness(store, owner.job, self.lease)
        self._claims = Claims(store, owner, self.lease, self._liveness, on_error=self._failed,
                              on_success=self.health.answered)
        self._waiter = Waiter(store, lease_s=self.lease, wait_timeout_s=self.wait_timeout,
                              progress_interval_s=self.progress_interval, signalled_waits=signalled_waits,
                              liveness=self._liveness)
        self._told_too_large = False
        self._thread = threading.local()
        if signalled_waits:
            try:
                store.prepare_watch()
            except StoreError as exc:
                self._failed(exc)

    # -- state -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the store may be asked now (it answers, or its backoff has passed)."""
        return self.health.reachable()

    def _failed(self, exc: StoreError) -> None:
        self.health.failed(exc)

    def claim_started(self, key: str) -> float | None:
        """Wall-clock time this process claimed ``key``, or ``None`` if it holds no claim."""
        return self._claims.started(key)

    def holds_claims(self) -> bool:
        """Whether this process holds claims (it is inside a leaf step): it does not wait."""
        return self._claims.any()

    @contextlib.contextmanager
    def no_waits(self) -> Iterator[None]:
        """On this thread, for the duration, lookups claim or return at once: a key
        another process holds is ``nonblocking`` instead of waited for."""
        outer = getattr(self._thread, "no_waits", False)
        self._thread.no_waits = True
        try:
            yield
        finally:
            self._thread.no_waits = outer

    def _may_wait(self) -> bool:
        """A rank holding a claim may try to claim more, but must not wait (no cycles)."""
        return not self.holds_claims() and not getattr(self._thread, "no_waits", False)

    # -- the protocol --------------------------------------------------------------------

    def lookup(self, key: str, *, blocking: bool, before_waiting: Callable[[], bool] | None = None,
               rejected: bytes | None = None, what: str | None = None) -> LookupResult:
        """Find ``key``'s value; see the module docstring for what happens on a miss.
        Before a wait, ``before_waiting`` (if given) is called until it returns False
        or the value is published. ``rejected``: a value of ``key`` the caller refused,
        which counts as missing (one rank claims the key again, the others wait).
        ``what``: what this process computes for ``key``, for a claim's record (default:
        ``describe(key)``)."""
        if not self.available:
            return LookupResult(None, Outcome.UNAVAILABLE)
        try:
            # A store that refuses writes is only read: a miss claims nothing (it may wait
            # for a claim another process holds, which thought it could publish).
            result = self._lookup(key, blocking, before_waiting, rejected, what, may_claim=self.health.writable())
        except StoreError as exc:
            self._failed(exc)
            return LookupResult(None, Outcome.UNAVAILABLE)
        self.health.answered()
        return result

    def _lookup(self, key: str, blocking: bool, before_waiting: Callable[[], bool] | None = None,
                rejected: bytes | None = None, what: str | None = None, *, may_claim: bool = True) -> LookupResult:
        value = self._waiter.published(f"v/{key}", rejected)
        if value is not None:
            return LookupResult(value, Outcome.HIT)
        if not blocking:
            return LookupResult(None, Outcome.NONBLOCKING)
        return self._claim_or_wait(key, f"v/{key}", before_waiting, rejected, what, may_claim=may_claim)

    def follow(self, key: str, *, grace_s: float = 0.0) -> LookupResult:
        """Wait for ``key``'s value while another process holds a claim on it, never
        claiming it (``coordinator.features.split_shares``: slots only their owners claim).

        Outcomes: ``hit`` or ``waited`` with the value; ``unclaimed`` (nobody claimed it
        within ``grace_s``); ``abandoned``; ``expired`` (the claimant's lease lapsed; it is
        not taken over); ``deadline``; ``nonblocking`` (this process holds claims, or
        waits nowhere now); ``unavailable``.
        """
        if not self.available:
            return LookupResult(None, Outcome.UNAVAILABLE)
        try:
            result = self._follow(key, grace_s)
        except StoreError as exc:
            self._failed(exc)
            return LookupResult(None, Outcome.UNAVAILABLE)
        self.health.answered()
        return result

    def _follow(self, key: str, grace_s: float) -> LookupResult:
        published = f"v/{key}"
        value = self.store.get(published)
        if value is not None:
            return LookupResult(value, Outcome.HIT)
        if not self._may_wait():
            return LookupResult(None, Outcome.NONBLOCKING)
        started = time.monotonic()
        while self.store.get(f"c/{key}/0") is None:
            # Not claimed yet (its owner may still be on its way), or published and its
            # claim deleted since the first read.
            value = self.store.get(published)
            if value is not None:
                return LookupResult(value, Outcome.HIT, time.monotonic() - started)
            if time.monotonic() - started >= grace_s:
                return LookupResult(None, Outcome.UNCLAIMED, time.monotonic() - started)
            time.sleep(0.05)
        gen = latest_gen(self.store, key, 0)
        wait_began = time.time()
        outcome, value, owner_rank = self._waiter.wait(key, gen, started, published)
        self.events.span("wait", wait_began, key=short_key(key), owner=owner_rank, ended=WAIT_ENDINGS[outcome])
        return LookupResult(value, outcome, time.monotonic() - started)

    def offer(self, key: str, what: str | None = None) -> LookupResult:
        """For a value this process already holds: make sure the store gets it, or wait
        for the rank computing it.

        Never fetches the value. Outcomes: ``hit`` (the store has it), ``claimed`` (the
        caller must :meth:`publish` its copy now, or :meth:`abandon`), ``waited`` (another
        rank was computing it and published), ``abandoned``/``deadline`` (that rank gave
        up, or the wait hit the deadline), ``nonblocking`` (this process holds claims, so
        it does not wait), ``unavailable``.
        """
        if not self.available:
            return LookupResult(None, Outcome.UNAVAILABLE)
        try:
            if self.store.get(f"d/{key}") is not None:
                result = LookupResult(None, Outcome.HIT)
            else:
                result = self._claim_or_wait(key, f"d/{key}", what=what, may_claim=self.health.writable())
        except StoreError as exc:
            self._failed(exc)
            return LookupResult(None, Outcome.UNAVAILABLE)
        self.health.answered()
        return LookupResult(None, result.outcome, result.waited_s)

    def _claim_or_wait(self, key: str, published: str, before_waiting: Callable[[], bool] | None = None,
                       rejected: bytes | None = None, what: str | None = None, *,
                       may_claim: bool = True, may_wait: bool | None = None) -> LookupResult:
        """Claim ``key``, or wait while another process holds it until store key
        ``published`` appears (returning its value), the claim is abandoned or expires
        (then try to claim the next generation), or the deadline passes. With
        ``rejected``, that value of ``published`` counts as absent, and the claim is the
        key's redo claim for it. ``what`` goes into the claim's record (default:
        ``describe(key)``). Without ``may_claim`` (the store refuses writes), a key nobody
        holds is ``nonblocking``: computed here, unclaimed. ``may_wait`` overrides whether
        this thread may wait (default: it holds no claim and runs without ``no_waits``)."""
        if may_wait is None:
            may_wait = self._may_wait()
        at = key if rejected is None else f"{key}/redo-{hashlib.sha256(rejected).hexdigest()[:16]}"
        if what is None:
            what = self._describe(key) if self._describe is not None else ""
        started = time.monotonic()
        gen = 0
        while True:
            if not may_claim:
                if self.store.get(f"c/{at}/{gen}") is None:
                    return LookupResult(None, Outcome.NONBLOCKING)
            elif self._claims.take(key, gen, at, what):
                # Re-check: the value may have been published (and its claim deleted)
                # between our first read and the claim.
                value = self._waiter.published(published, rejected)
                if value is not None:
                    self._claims.drop(key)
                    return LookupResult(value, Outcome.HIT)
                return LookupResult(None, Outcome.CLAIMED, time.monotonic() - started)
            if not may_wait:
                return LookupResult(None, Outcome.NONBLOCKING)
            gen = latest_gen(self.store, at, gen)
            if before_waiting is not None:
                value = self._work_first(before_waiting, published, rejected)
                before_waiting = None
                if value is not None:
                    return LookupResult(value, Outcome.WAITED, time.monotonic() - started)
                continue  # the claim may have ended meanwhile: try it again
            wait_began = time.time()
            outcome, value, owner_rank = self._waiter.wait(at, gen, started, published, rejected)
            self.events.span("wait", wait_began, key=short_key(key), owner=owner_rank, ended=WAIT_ENDINGS[outcome])
            if outcome == Outcome.EXPIRED:
                gen += 1
                continue
            return LookupResult(value, outcome, time.monotonic() - started)

    def claim_or_follow(self, key: str, *, what: str | None = None) -> LookupResult:
        """:meth:`lookup` of a key whose holders wait on nothing while they hold it (a share
        of a GEMM selection: ``coordinator.features.split_tuning``): claim it, or wait while
        another process holds it, taking it over when its lease lapses, even though this
        process holds other claims or runs with :meth:`no_waits`. The caller must hold no
        claim of such a key meanwhile: a rank that waits here then waits on a rank that
        waits on nobody, so no cycle forms (``docs/design.md``).

        Outcomes: ``hit``/``waited`` with the value, ``claimed`` (first, or after a lapsed
        lease), ``abandoned``, ``deadline``, ``nonblocking`` (the store refuses writes and
        nobody holds it), ``unavailable``.
        """
        if not self.available:
            return LookupResult(None, Outcome.UNAVAILABLE)
        try:
            value = self._waiter.published(f"v/{key}", None)
            if value is not None:
                result = LookupResult(value, Outcome.HIT)
            else:
                result = self._claim_or_wait(key, f"v/{key}", what=what, may_claim=self.health.writable(),
                                             may_wait=True)
        except StoreError as exc:
            self._failed(exc)
            return LookupResult(None, Outcome.UNAVAILABLE)
        self.health.answered()
        return result

    def settle(self, key: str, value: bytes) -> bytes | None:
        """Write ``key``'s value once: the first value any process settles stands, later
        ones are dropped. Returns the value that stands (``None``: the store failed). A
        claim on ``key`` is then ended with :meth:`publish` of that value."""
        if not self.available:
            return None
        try:
            if self.store.add_if_absent(f"v/{key}", value):
                standing = value
            else:
                standing = self.store.get(f"v/{key}")
        except StoreError as exc:
            self._failed(exc)
            return None
        self.health.answered()
        return standing

    def _work_first(self, work: Callable[[], bool], published: str, rejected: bytes | None) -> bytes | None:
        """Run ``work`` until it has nothing left or store key ``published`` appears."""
        while work():
            value = self._waiter.published(published, rejected)
            if value is not None:
                return value
        return None

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
        if not self.health.writable():
            self._release(self._claims.pop(key))
            return False
        try:
            unsent = self._too_large(len(value))
            if not unsent:
                self.store.set(f"v/{key}", value)
        except StoreError as exc:
            self._failed(exc)
            unsent = True
        if unsent:
            self._release(self._claims.pop(key))
            return False
        claim = self._claims.pop(key)
        try:
            if claim is not None:
                self._claims.signal_end(claim, VALUE + value if len(value) <= INLINE_VALUE_BYTES else PUBLISHED)
            self.store.set(f"d/{key}", b"1")
        except StoreError as exc:
            self._failed(exc)
        else:
            self.health.wrote()
        if claim is not None:
            self._claims.delete(key, claim)
        return True

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
        def write() -> None:
            try:
                blob = value()
            except BaseException:
                self.abandon(key, publishing=True)
                raise
            ok = self.publish(key, blob)
            if published is not None:
                published(ok, blob)

        if self.writer is None:
            write()
            return True
        self._claims.hand_off(key)
        if self.writer.submit(what, nbytes, write):
            return True
        if not self._told_full:
            self._told_full = True
            log.warning("compile_once: %.1f MB wait to be published, the bound is %.1f MB (publish_queue_mb): %s is "
                        "not published; other ranks compile it", self.writer.pending()[1] / 1e6,
                        self.writer.max_bytes / 1e6, what)
        self.abandon(key, publishing=True)
        return False

    def _too_large(self, size: int) -> bool:
        """Whether a value of ``size`` bytes is larger than the store can hold (said once)."""
        limit = self.store.capacity()
        if limit is None or size <= limit:
            return False
        if not self._told_too_large:
            self._told_too_large = True
            log.warning("coordinator store %s holds at most %d bytes (%.2f MB: maxmemory less the server's own use); "
                        "a value of %d bytes (%.2f MB) is not sent to it, nor any other value over that limit: "
                        "each rank compiles those graphs", self.store.name, limit, limit / 1e6, size, size / 1e6)
        return True

    def _release(self, claim: Claim | None) -> None:
        """Release a claim this process will not finish, at once where the store answers,
        else from the heartbeat thread."""
        if claim is None:
            return
        if self.health.reachable():
            error = self._claims.release(claim)
            if error is None:
                return
            self._failed(error)
        self._claims.release_later(claim)

    @property
    def job(self) -> str:
        """The job this process's claims name (``liveness.this_job``)."""
        return self.owner.job

    def first_to_mark(self, key: str, mark: str | int, *, ttl: timedelta | None = None) -> bool:
        """Set the once-only mark ``n/<key>/<mark>``: whether this process set it first.
        ``ttl``: how long the mark lives, where the store expires keys.

        Raises:
            StoreError: the store failed (the caller decides; the next publish or lookup
                finds the store failed and records it).
        """
        # A value of this call's own: a store whose create-if-absent returns the value it
        # found (the c10d store's compare_set) must not tell a second setter it was first.
        return self.store.add_if_absent(f"n/{key}/{mark}", uuid.uuid4().hex.encode(), ttl=ttl)

    def unmark(self, key: str, mark: str | int) -> None:
        """Delete the mark ``n/<key>/<mark>``, so that the next :meth:`first_to_mark` sets it.

        Raises:
            StoreError: the store failed.
        """
        self.store.delete(f"n/{key}/{mark}")

    def abandon(self, key: str, *, publishing: bool = False) -> None:
        """Tell waiters that this process will not publish ``key``. A claim whose value is
        being written behind the compile is left to that write unless ``publishing``."""
        self._release(self._claims.pop(key, publishing=publishing))

    def abandon_all(self) -> int:
        """Abandon every claim whose value is still being computed (a compile ended
        without publishing them); claims being written behind the compile stay.

        Returns:
            How many claims were abandoned.
        """
        keys = self._claims.keys()
        for key in keys:
            self.abandon(key)
        return len(keys)

    def drain(self, timeout: timedelta) -> bool:
        """Let the writes behind the compile finish, up to ``timeout``; whether all did."""
        if self.writer is None:
            return True
        writes, nbytes = self.writer.pending()
        if writes and self.writer.drain(timeout):
            return True
        if writes:
            log.warning("compile_once: %d entries (%.1f MB) were not published within %.0fs; the ranks or jobs that "
                        "need them compile them", writes, nbytes / 1e6, timeout.total_seconds())
            return False
        return True

    def close(self) -> None:
        """Stop the writer (what it has not written is lost), abandon the claims still held,
        stop the heartbeat thread, and delete this job's liveness key if this process wrote it."""
        if self.writer is not None:
            self.writer.close()
        for key in self._claims.keys(publishing=True):
            self.abandon(key, publishing=True)
        self._claims.heartbeat.stop()
        if self.health.reachable():
            self._liveness.end()
