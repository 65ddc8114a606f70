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

:meth:`Singleflight.lookup` returns the value if it is published. Otherwise it
tries to create claim 0; the rank that succeeds gets ``None`` back, computes the
value and calls :meth:`publish`. The others wait on the store (never inside a
collective) until one of four things happens:

* the value is published: they return it;
* the claimant marks the claim abandoned (Inductor bypassed the cache for that
  graph, or its compile failed): they return ``None`` and compute locally;
* the heartbeat stops moving for a whole lease (the claimant died): each tries to
  create claim ``gen + 1``; exactly one succeeds and computes, the others follow it;
* the configured deadline passes: they compute locally.

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
Waiters log a progress line every ``progress_interval``. Liveness is judged by each
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
collectives; PGO profiles) are never waited on, only read. Any store failure disables
the store for this process and every later lookup returns ``None``: losing the
coordinator costs compile time, never the job.

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
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import msgpack

from coordinator.errors import StoreError
from coordinator.observe.trace import NO_EVENTS, WAIT_ENDINGS, NoEvents, short_key
from coordinator.protocol.stores.base import PollingWatch, Store

log = logging.getLogger(__name__)

#: Claims in stores with expiry outlive any compile; stale ones are taken over by heartbeat.
_CLAIM_TTL = timedelta(days=1)

#: What a claimant writes in its signal slots ``w/<key>/<gen>/<n>``.
BEAT = b"beat"
MOVED = b"moved"
ABANDONED = b"abandoned"
PUBLISHED = b"published"  # the value is in v/<key>
VALUE = b"value:"  # followed by the value itself
#: Values up to this size ride in the end signal, so that a woken waiter makes no further
#: store call; larger ones are read from v/<key> right after the wake-up (and a value in
#: the signal is stored twice: in v/<key> for later lookups, and in the signal).
INLINE_VALUE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a claim, for log lines."""

    rank: int
    host: str
    pid: int

    @classmethod
    def this_process(cls, rank: int) -> Owner:
        return cls(rank, socket.gethostname(), os.getpid())

    @classmethod
    def of_claim(cls, record: bytes | None) -> Owner | None:
        """The owner a claim's record names (``None``: no record)."""
        if record is None:
            return None
        rank, host, pid, _ = msgpack.unpackb(record)
        return cls(rank, host, pid)

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


@dataclasses.dataclass(slots=True)
class _Claim:
    gen: int
    since: float  # wall clock, for finding the files a compile produced
    at: str  # the claim's name: c/<at>/<gen>, h/<at>/<gen>, ... (the key, or its redo name)
    beats: int = 0
    ended: bool = False  # published or abandoned: no more beats
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass(slots=True)
class LookupResult:
    """The outcome of a lookup: a value, or why there is none."""

    value: bytes | None
    outcome: str  # hit | claimed | waited | abandoned | deadline | nonblocking | unavailable
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
    ) -> None:
        self.store = store
        self.events = events
        #: Block on the claimant's signals (heartbeats, end, moved) where the store can;
        #: False polls them.
        self.signalled_waits = signalled_waits
        self.owner = owner
        self.lease = lease.total_seconds()
        self.wait_timeout = wait_timeout.total_seconds()
        self.progress_interval = progress_interval.total_seconds()
        self._claims: dict[str, _Claim] = {}
        self._lock = threading.Lock()
        self._heartbeat = _Heartbeat(self)
        self._broken: str | None = None
        self._thread = threading.local()
        if signalled_waits:
            try:
                store.prepare_watch()
            except StoreError as exc:
                self._fail(exc)

    # -- state -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._broken is None

    def _fail(self, exc: StoreError) -> None:
        if self._broken is None:
            self._broken = str(exc)
            self.events.instant("store lost", error=str(exc))
            log.warning("coordinator store %s failed, compiling locally from now on: %s", self.store.name, exc)

    def claim_started(self, key: str) -> float | None:
        """Wall-clock time this process claimed ``key``, or ``None`` if it holds no claim."""
        with self._lock:
            claim = self._claims.get(key)
        return claim.since if claim else None

    def holds_claims(self) -> bool:
        """Whether this process holds claims (it is inside a leaf step): it does not wait."""
        with self._lock:
            return bool(self._claims)

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

    # -- the protocol --------------------------------------------------------------------

    def lookup(self, key: str, *, blocking: bool, before_waiting: Callable[[], bool] | None = None,
               rejected: bytes | None = None) -> LookupResult:
        """Find ``key``'s value; see the module docstring for what happens on a miss.
        Before a wait, ``before_waiting`` (if given) is called until it returns False
        or the value is published. ``rejected``: a value of ``key`` the caller refused,
        which counts as missing (one rank claims the key again, the others wait)."""
        if not self.available:
            return LookupResult(None, "unavailable")
        try:
            return self._lookup(key, blocking, before_waiting, rejected)
        except StoreError as exc:
            self._fail(exc)
            return LookupResult(None, "unavailable")

    def _lookup(self, key: str, blocking: bool, before_waiting: Callable[[], bool] | None = None,
                rejected: bytes | None = None) -> LookupResult:
        value = self._published(f"v/{key}", rejected)
        if value is not None:
            return LookupResult(value, "hit")
        if not blocking:
            return LookupResult(None, "nonblocking")
        return self._claim_or_wait(key, f"v/{key}", before_waiting, rejected)

    def _published(self, published: str, rejected: bytes | None) -> bytes | None:
        """Store key ``published``'s value, unless it is the ``rejected`` one."""
        value = self.store.get(published)
        return None if value is None or value == rejected else value

    def follow(self, key: str, *, grace_s: float = 0.0) -> LookupResult:
        """Wait for ``key``'s value while another process holds a claim on it, never
        claiming it (``coordinator.features.split_shares``: slots only their owners claim).

        Outcomes: ``hit`` or ``waited`` with the value; ``unclaimed`` (nobody claimed it
        within ``grace_s``); ``abandoned``; ``expired`` (the claimant's lease lapsed; it is
        not taken over); ``deadline``; ``nonblocking`` (this process holds claims, or
        waits nowhere now); ``unavailable``.
        """
        if not self.available:
            return LookupResult(None, "unavailable")
        try:
            return self._follow(key, grace_s)
        except StoreError as exc:
            self._fail(exc)
            return LookupResult(None, "unavailable")

    def _follow(self, key: str, grace_s: float) -> LookupResult:
        published = f"v/{key}"
        value = self.store.get(published)
        if value is not None:
            return LookupResult(value, "hit")
        if self.holds_claims() or getattr(self._thread, "no_waits", False):
            return LookupResult(None, "nonblocking")
        started = time.monotonic()
        while self.store.get(f"c/{key}/0") is None:
            # Not claimed yet (its owner may still be on its way), or published and its
            # claim deleted since the first read.
            value = self.store.get(published)
            if value is not None:
                return LookupResult(value, "hit", time.monotonic() - started)
            if time.monotonic() - started >= grace_s:
                return LookupResult(None, "unclaimed", time.monotonic() - started)
            time.sleep(0.05)
        gen = self._latest_gen(key, 0)
        wait_began = time.time()
        outcome, value, owner_rank = self._wait(key, gen, started, published)
        self.events.span("wait", wait_began, key=short_key(key), owner=owner_rank, ended=WAIT_ENDINGS[outcome])
        return LookupResult(value, outcome, time.monotonic() - started)

    def offer(self, key: str) -> LookupResult:
        """For a value this process already holds: make sure the store gets it, or wait
        for the rank computing it.

        Never fetches the value. Outcomes: ``hit`` (the store has it), ``claimed`` (the
        caller must :meth:`publish` its copy now, or :meth:`abandon`), ``waited`` (another
        rank was computing it and published), ``abandoned``/``deadline`` (that rank gave
        up, or the wait hit the deadline), ``nonblocking`` (this process holds claims, so
        it does not wait), ``unavailable``.
        """
        if not self.available:
            return LookupResult(None, "unavailable")
        try:
            if self.store.get(f"d/{key}") is not None:
                return LookupResult(None, "hit")
            result = self._claim_or_wait(key, f"d/{key}")
        except StoreError as exc:
            self._fail(exc)
            return LookupResult(None, "unavailable")
        return LookupResult(None, result.outcome, result.waited_s)

    def _claim_or_wait(self, key: str, published: str, before_waiting: Callable[[], bool] | None = None,
                       rejected: bytes | None = None) -> LookupResult:
        """Claim ``key``, or wait while another process holds it until store key
        ``published`` appears (returning its value), the claim is abandoned or expires
        (then try to claim the next generation), or the deadline passes. With
        ``rejected``, that value of ``published`` counts as absent, and the claim is the
        key's redo claim for it."""
        # A rank holding a claim may try to claim more, but must not wait (no cycles).
        may_wait = not self.holds_claims() and not getattr(self._thread, "no_waits", False)
        at = key if rejected is None else f"{key}/redo-{hashlib.sha256(rejected).hexdigest()[:16]}"
        started = time.monotonic()
        gen = 0
        while True:
            if self._try_claim(key, gen, at):
                # Re-check: the value may have been published (and its claim deleted)
                # between our first read and the claim.
                value = self._published(published, rejected)
                if value is not None:
                    self._drop_claim(key)
                    return LookupResult(value, "hit")
                return LookupResult(None, "claimed", time.monotonic() - started)
            if not may_wait:
                return LookupResult(None, "nonblocking")
            gen = self._latest_gen(at, gen)
            if before_waiting is not None:
                value = self._work_first(before_waiting, published, rejected)
                before_waiting = None
                if value is not None:
                    return LookupResult(value, "waited", time.monotonic() - started)
                continue  # the claim may have ended meanwhile: try it again
            wait_began = time.time()
            outcome, value, owner_rank = self._wait(at, gen, started, published, rejected)
            self.events.span("wait", wait_began, key=short_key(key), owner=owner_rank, ended=WAIT_ENDINGS[outcome])
            if outcome == "expired":
                gen += 1
                continue
            return LookupResult(value, outcome, time.monotonic() - started)

    def _work_first(self, work: Callable[[], bool], published: str, rejected: bytes | None) -> bytes | None:
        """Run ``work`` until it has nothing left or store key ``published`` appears."""
        while work():
            value = self._published(published, rejected)
            if value is not None:
                return value
        return None

    def _try_claim(self, key: str, gen: int, at: str) -> bool:
        """Create claim ``c/<at>/<gen>`` for ``key``."""
        record = msgpack.packb([self.owner.rank, self.owner.host, self.owner.pid, time.time()])
        if not self.store.add_if_absent(f"c/{at}/{gen}", record, ttl=_CLAIM_TTL):
            return False
        with self._lock:
            self._claims[key] = _Claim(gen, time.time(), at)
        self.store.set(f"h/{at}/{gen}", msgpack.packb([0, time.time()]))
        self._heartbeat.ensure_running()
        if gen > 0:
            self._signal_moved(at, gen - 1)
        log.debug("claimed %s (generation %d)", at, gen)
        return True

    def _signal_moved(self, key: str, gen: int) -> None:
        """Wake the waiters of claim ``gen``, which this process took over. They wait on
        the signal after the last heartbeat, or on that heartbeat's own signal if the
        claimant died between writing the two; an occupied slot keeps its value."""
        raw_beat = self.store.get(f"h/{key}/{gen}")
        beats = msgpack.unpackb(raw_beat)[0] if raw_beat is not None else 0
        for n in range(max(beats, 1), beats + 2):
            self.store.signal(f"w/{key}/{gen}/{n}", MOVED)

    def _latest_gen(self, key: str, gen: int) -> int:
        while self.store.get(f"c/{key}/{gen + 1}") is not None:
            gen += 1
        return gen

    def _judge(self, key: str, owner: str, started: float, last_change: float, next_progress: float,
               now: float, lease: float) -> tuple[str | None, float]:
        """How a wait that has seen no value ends now ("expired": no heartbeat for a lease;
        "deadline"), or ``None``; logs the progress line when due. Returns the outcome and
        when the next progress line is due."""
        if now - last_change > lease:
            log.warning("lease of %s on %s expired (no heartbeat for %.1fs); taking over",
                        owner, key, now - last_change)
            return "expired", next_progress
        if now - started > self.wait_timeout:
            log.warning("waited %.0fs for %s held by %s, past the %.0fs deadline; compiling locally",
                        now - started, key, owner, self.wait_timeout)
            return "deadline", next_progress
        if now >= next_progress:
            log.info("waiting for %s: held by %s, waited %.0fs, last heartbeat %.1fs ago",
                     key, owner, now - started, now - last_change)
            next_progress = now + self.progress_interval
        return None, next_progress

    def _wait(self, at: str, gen: int, started: float, published: str,
              rejected: bytes | None = None) -> tuple[str, bytes | None, int | None]:
        """Wait for the claimant's signals: ``w/<key>/<gen>/<n>`` is written at its n-th
        heartbeat ("beat") and once when the claim ends (the value itself, "published" or
        "abandoned"). On a store that can block (and with ``signalled_waits``), an idle
        waiter makes about one store call per heartbeat (lease/4), and the end signal is
        the last call of a wait; elsewhere it polls the next signal's slot. Returns the
        outcome, the value (if it came with the end signal) and the claimant's rank.
        ``at`` names the claim (the key, or its redo name)."""
        owner = Owner.of_claim(self.store.get(f"c/{at}/{gen}"))
        ended, value = self._wait_on(at, gen, started, published, str(owner or "unknown owner"), rejected)
        return ended, value, owner.rank if owner is not None else None

    def _wait_on(self, key: str, gen: int, started: float, published: str, owner: str,
                 rejected: bytes | None) -> tuple[str, bytes | None]:
        raw_beat = self.store.get(f"h/{key}/{gen}")
        beats = msgpack.unpackb(raw_beat)[0] if raw_beat is not None else 0
        last_change = time.monotonic()
        next_progress = last_change + self.progress_interval
        check = True
        wants_value = published.startswith("v/")
        # Waiters of a dead claimant judge it at different moments: the first takes over
        # and signals "moved", which ends the others' waits before they time out.
        lease = self.lease * (1 + random.uniform(0, 0.1))
        watching = (self.store.watch(f"w/{key}/{gen}") if self.signalled_waits
                    else contextlib.nullcontext(PollingWatch(self.store)))
        with watching as watch:
            while True:
                if check:
                    value = self._published(published, rejected)
                    if value is not None:
                        return "waited", value
                    if self.store.get(f"a/{key}/{gen}") is not None:
                        return self._abandoned(key, owner)
                    check = False
                now = time.monotonic()
                ended, next_progress = self._judge(key, owner, started, last_change, next_progress, now,
                                                   lease=lease)
                if ended:
                    return ended, None
                # No timeout for the progress line: a live claimant signals every lease/4,
                # and each signal brings the judgement round again. A timed-out c10d wait
                # is costly (TCPStore cancels it and logs a warning).
                timeout = min(last_change + lease, started + self.wait_timeout) - now
                signal = watch.wait(f"w/{key}/{gen}/{beats + 1}", max(timeout, 0.0) + 0.001)
                if signal is None:
                    continue
                beats += 1
                last_change = time.monotonic()
                if signal == BEAT:
                    continue
                if signal.startswith(VALUE):
                    return "waited", signal[len(VALUE):]
                if signal == ABANDONED:
                    return self._abandoned(key, owner)
                if signal == MOVED:
                    log.info("%s on %s was taken over; following the new claimant", owner, key)
                    return "expired", None
                if signal == PUBLISHED and not wants_value:
                    return "waited", None  # an offer: the value is published, d/ follows it
                # PUBLISHED (read v/, written before the signal), or a signal this version
                # does not know: read the store, as a poll would.
                check = True

    def _abandoned(self, key: str, owner: str) -> tuple[str, None]:
        log.info("%s gave up on %s without publishing; compiling locally", owner, key)
        return "abandoned", None

    def _signal_end(self, claim: _Claim, signal: bytes) -> None:
        """Wake this claim's waiters with how it ended (the value, "published" or
        "abandoned"); no heartbeat follows."""
        with claim.lock:
            claim.ended = True
            slot = claim.beats + 1
        self.store.signal(f"w/{claim.at}/{claim.gen}/{slot}", signal)

    def publish(self, key: str, value: bytes) -> bool:
        """Store ``key``'s value and release this process's claim on it.

        The value is written first, then the end signal (carrying a small value), then
        the "done" marker, then the claim's own keys are deleted: a woken waiter finds
        everything it reads already written.

        Returns:
            False if the store failed (the value stays local).
        """
        if not self.available:
            return False
        try:
            self.store.set(f"v/{key}", value)
            with self._lock:
                claim = self._claims.pop(key, None)
            if claim is not None:
                self._signal_end(claim, VALUE + value if len(value) <= INLINE_VALUE_BYTES else PUBLISHED)
            self.store.set(f"d/{key}", b"1")
        except StoreError as exc:
            self._fail(exc)
            return False
        if claim is not None:
            self._delete_claim(key, claim)
        return True

    def abandon(self, key: str) -> None:
        """Tell waiters that this process will not publish ``key``."""
        with self._lock:
            claim = self._claims.pop(key, None)
        if claim is None or not self.available:
            return
        try:
            self.store.set(f"a/{claim.at}/{claim.gen}", msgpack.packb(time.time()))
            self._signal_end(claim, ABANDONED)
            log.debug("abandoned claim on %s (generation %d)", claim.at, claim.gen)
        except StoreError as exc:
            self._fail(exc)

    def abandon_all(self) -> int:
        """Abandon every claim still held (a compile ended without publishing them).

        Returns:
            How many claims were abandoned.
        """
        with self._lock:
            keys = list(self._claims)
        for key in keys:
            self.abandon(key)
        return len(keys)

    def _drop_claim(self, key: str) -> None:
        """Release a claim whose value another process published meanwhile."""
        with self._lock:
            claim = self._claims.pop(key, None)
        if claim is None:
            return
        try:
            self._signal_end(claim, PUBLISHED)
        except StoreError as exc:
            log.debug("could not signal the end of claim on %s: %s", key, exc)
        self._delete_claim(key, claim)

    def _delete_claim(self, key: str, claim: _Claim) -> None:
        try:
            self.store.delete(f"c/{claim.at}/{claim.gen}")
            self.store.delete(f"h/{claim.at}/{claim.gen}")
        except StoreError as exc:
            log.debug("could not delete claim on %s: %s", key, exc)

    def close(self) -> None:
        """Abandon held claims and stop the heartbeat thread."""
        self.abandon_all()
        self._heartbeat.stop()


class _Heartbeat:
    """The thread that bumps the heartbeat of every claim a process holds, every lease/4,
    and signals each beat to the claim's waiters; none after a claim's end signal."""

    def __init__(self, flight: Singleflight) -> None:
        self._flight = flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_running(self) -> None:
        with self._flight._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat_forever, name="coordinator-heartbeat", daemon=True)
            self._thread.start()

    def _beat_forever(self) -> None:
        flight = self._flight
        while not self._stop.wait(flight.lease / 4):
            with flight._lock:
                claims = list(flight._claims.items())
            for key, claim in claims:
                try:
                    with claim.lock:  # no beat after the end signal
                        if claim.ended:
                            continue
                        claim.beats += 1
                        flight.store.set(f"h/{claim.at}/{claim.gen}", msgpack.packb([claim.beats, time.time()]))
                        flight.store.signal(f"w/{claim.at}/{claim.gen}/{claim.beats}", BEAT)
                except StoreError as exc:
                    log.debug("heartbeat for %s failed: %s", key, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._flight.lease)
