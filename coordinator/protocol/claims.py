"""The claims one process holds in a singleflight store, and the heartbeat that keeps them.

A claim is ``c/<at>/<gen>`` (created atomically), with its heartbeat ``h/<at>/<gen>``
and its signals ``w/<at>/<gen>/<n>``: ``at`` is the key, or its redo name
(``coordinator.protocol.singleflight`` describes the protocol). Its record is a map that
names the claimant: ``rank``, ``host``, ``pid``, the time ``t``, its ``job``
(``coordinator.protocol.liveness``, whose key the claimant writes before the claim and at
every heartbeat) and ``what``: what the claimant computes, in words (``"backward graph 1 of
'forward' (compile 0/0)"``), which a waiting rank's lines name (:func:`claim_record` reads
it). Records of earlier versions are a list ``[rank, host, pid, t]``.

Where the store expires keys (Redis), a claim's keys live as long as the claim needs them:
the heartbeat writes its beat, its signals and the abandoned marker to live
``KEYS_TTL_LEASES`` leases, and extends the claim itself (and the claims of the generations
before it, which newcomers follow to it) to ``CLAIM_TTL_LEASES`` leases at every beat. A
claim whose claimant stopped is taken over by its waiters after one lease, and is gone from
the store a few leases later, after every key of it, so that a later claim of the same
generation finds none of the old one's keys.

:class:`Claims` is the one owner of a claim's end, whichever way it ends:

* published (:meth:`Claims.published`): after the value is written, the end signal (carrying
  a small value), the "done" marker, then the claim's own keys deleted;
* published by another process meanwhile (:meth:`Claims.drop`);
* handed off (:meth:`Claims.hand_off`): the value is computed and only its writing is left,
  which ends without waiting on anything;
* abandoned (:meth:`Claims.abandon`): a claim the process can no longer finish (its publish
  failed, the store refuses writes, its compile failed) is marked abandoned and its waiters
  woken, best effort; where the marker cannot be written (a store that refuses writes) the
  claim is deleted instead, which a waiter reads as the same. A release the store does not
  answer, or that is asked while the store is in its backoff, is retried by the heartbeat
  thread for a lease.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgpack

from coordinator.errors import StoreError
from coordinator.protocol.liveness import PROCESS_JOB, JobLiveness
from coordinator.protocol.stores.base import Store

log = logging.getLogger(__name__)

#: Where keys expire: a claim lives this many leases past its claimant's last heartbeat...
CLAIM_TTL_LEASES = 3
#: ... and its heartbeat, signals and abandoned marker this many past their write.
KEYS_TTL_LEASES = 2

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
    """Who holds a claim: for log lines, and its job for the judgement of stale claims."""

    rank: int
    host: str
    pid: int
    job: str = ""  # "" in a claim written before claims named their job

    @classmethod
    def this_process(cls, rank: int, job: str | None = None) -> Owner:
        """This process; ``job`` defaults to an id of this process alone."""
        return cls(rank, socket.gethostname(), os.getpid(), job or PROCESS_JOB)

    @classmethod
    def of_claim(cls, record: bytes | None) -> Owner | None:
        """The owner a claim's record names (``None``: no record). Reads the map, and the
        list ``[rank, host, pid, time]`` of claims written before it."""
        if record is None:
            return None
        fields = claim_record(record)
        return cls(fields["rank"], fields["host"], fields["pid"], fields.get("job", ""))

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


def claim_record(record: bytes) -> dict:
    """A claim's record as a map: ``rank``, ``host``, ``pid``, ``t`` and, where the claimant
    wrote it, ``what`` (see the module); a record in the list form of earlier versions
    gives the first four."""
    fields = msgpack.unpackb(record)
    if isinstance(fields, (list, tuple)):
        rank, host, pid, t = fields[:4]
        return {"rank": rank, "host": host, "pid": pid, "t": t}
    return fields


@dataclasses.dataclass(slots=True)
class Claim:
    gen: int
    since: float  # wall clock, for finding the files a compile produced
    at: str  # the claim's name: c/<at>/<gen>, h/<at>/<gen>, ... (the key, or its redo name)
    beats: int = 0
    ended: bool = False  # published or abandoned: no more beats
    #: Its value is computed and being written behind the compile (``Singleflight.publish_behind``):
    #: it ends without waiting on anything, so it keeps its holder from no wait.
    publishing: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def beats_of(store: Store, at: str, gen: int) -> int:
    """The heartbeats claim ``gen`` of ``at`` has made so far."""
    raw_beat = store.get(f"h/{at}/{gen}")
    return msgpack.unpackb(raw_beat)[0] if raw_beat is not None else 0


def latest_gen(store: Store, at: str, gen: int) -> int:
    """The latest claim of ``at`` from generation ``gen`` on."""
    while store.get(f"c/{at}/{gen + 1}") is not None:
        gen += 1
    return gen


class Claims:
    """The claims this process holds in one store (by key), their creation, end signal,
    release and deletion, and the heartbeat that keeps them alive.

    ``on_error`` hears of every store failure met while publishing or abandoning a claim or
    beating, ``on_written`` of a publish's end written, ``on_success`` of each heartbeat round
    that met no failure; ``reachable`` tells whether the store may be asked now (else a
    release waits for the heartbeat thread).
    """

    def __init__(self, store: Store, owner: Owner, lease_s: float, liveness: JobLiveness, *,
                 on_error: Callable[[StoreError], None] = lambda exc: None,
                 on_success: Callable[[], None] = lambda: None,
                 on_written: Callable[[], None] = lambda: None,
                 reachable: Callable[[], bool] = lambda: True) -> None:
        self.store = store
        self.owner = owner
        self.lease = lease_s
        self.liveness = liveness
        self.on_error, self.on_success, self.on_written = on_error, on_success, on_written
        self.reachable = reachable
        expires = store.expires
        self.claim_ttl = timedelta(seconds=lease_s * CLAIM_TTL_LEASES) if expires else None
        self.keys_ttl = timedelta(seconds=lease_s * KEYS_TTL_LEASES) if expires else None
        self.held: dict[str, Claim] = {}
        #: Claims to release still, each with the monotonic time after which it is dropped.
        self.releasing: list[tuple[Claim, float]] = []
        self.lock = threading.Lock()
        self.heartbeat = Heartbeat(self, lease_s)

    def started(self, key: str) -> float | None:
        """Wall-clock time this process claimed ``key``, or ``None`` if it holds no claim."""
        with self.lock:
            claim = self.held.get(key)
        return claim.since if claim else None

    def any(self) -> bool:
        """Whether this process holds a claim whose value it is still computing."""
        with self.lock:
            return any(not claim.publishing for claim in self.held.values())

    def keys(self, *, publishing: bool = False) -> list[str]:
        """The claims whose value this process is still computing (and with ``publishing``,
        those being written too)."""
        with self.lock:
            return [key for key, claim in self.held.items() if publishing or not claim.publishing]

    def hand_off(self, key: str) -> None:
        """The value of ``key`` is computed: only its writing is left."""
        with self.lock:
            claim = self.held.get(key)
            if claim is not None:
                claim.publishing = True

    def pop(self, key: str, *, publishing: bool = True) -> Claim | None:
        """Stop holding ``key``'s claim and return it; a claim being written stays held
        unless ``publishing``."""
        with self.lock:
            claim = self.held.get(key)
            if claim is None or (claim.publishing and not publishing):
                return None
            return self.held.pop(key)

    def take(self, key: str, gen: int, at: str, what: str = "") -> bool:
        """Create claim ``c/<at>/<gen>`` for ``key``, after this job's liveness key; ``what``
        says what this process computes for it, in words."""
        self.liveness.beat(unless_fresh=True)
        fields = {"rank": self.owner.rank, "host": self.owner.host, "pid": self.owner.pid, "t": time.time(),
                  "job": self.owner.job}
        if what:
            fields["what"] = what
        if not self.store.add_if_absent(f"c/{at}/{gen}", msgpack.packb(fields), ttl=self.claim_ttl):
            return False
        with self.lock:
            self.held[key] = Claim(gen, time.time(), at)
        self.store.set(f"h/{at}/{gen}", msgpack.packb([0, time.time()]), ttl=self.keys_ttl)
        self.heartbeat.ensure_running()
        if gen > 0:
            self._signal_moved(at, gen - 1)
        log.debug("claimed %s (generation %d)", at, gen)
        return True

    def _signal_moved(self, at: str, gen: int) -> None:
        """Wake the waiters of claim ``gen``, which this process took over. They wait on
        the signal after the last heartbeat, or on that heartbeat's own signal if the
        claimant died between writing the two; an occupied slot keeps its value."""
        beats = beats_of(self.store, at, gen)
        for n in range(max(beats, 1), beats + 2):
            self.store.signal(f"w/{at}/{gen}/{n}", MOVED, ttl=self.keys_ttl)

    # -- a claim's end ---------------------------------------------------------------

    def published(self, key: str, value: bytes) -> None:
        """End ``key``'s claim after its value was written to ``v/<key>``: the end signal
        (carrying a value of up to ``INLINE_VALUE_BYTES``), the "done" marker ``d/<key>``
        (``on_error`` or ``on_written`` hears how they went), then the claim's own keys
        deleted, so that a woken waiter finds everything it reads already written. The marker
        is written even where this process held no claim (an offer's copy)."""
        claim = self.pop(key)
        try:
            if claim is not None:
                self._signal_end(claim, VALUE + value if len(value) <= INLINE_VALUE_BYTES else PUBLISHED)
            self.store.set(f"d/{key}", b"1")
        except StoreError as exc:
            self.on_error(exc)
        else:
            self.on_written()
        if claim is not None:
            self._delete(key, claim)

    def drop(self, key: str) -> None:
        """End a claim whose value another process published meanwhile."""
        claim = self.pop(key)
        if claim is None:
            return
        try:
            self._signal_end(claim, PUBLISHED)
        except StoreError as exc:
            log.debug("could not signal the end of claim on %s: %s", key, exc)
        self._delete(key, claim)

    def abandon(self, key: str, *, publishing: bool = True) -> None:
        """Release ``key``'s claim, which this process will not finish: at once where the
        store may be asked, else (or where it fails) from the heartbeat thread. A claim being
        written behind the compile is left to that write unless ``publishing``."""
        claim = self.pop(key, publishing=publishing)
        if claim is None:
            return
        if self.reachable():
            error = self.release(claim)
            if error is None:
                return
            self.on_error(error)
        with claim.lock:
            claim.ended = True  # no more beats: nothing will finish it
        with self.lock:
            self.releasing.append((claim, time.monotonic() + self.lease))
        self.heartbeat.ensure_running()

    def release(self, claim: Claim) -> StoreError | None:
        """Mark ``claim`` abandoned and wake its waiters, best effort; where the marker
        cannot be written, delete the claim instead (a waiter reads a missing claim as
        ended). Returns the store's error if the claim is neither marked nor deleted."""
        error: StoreError | None = None
        ended = False
        try:
            self.store.set(f"a/{claim.at}/{claim.gen}", msgpack.packb(time.time()), ttl=self.keys_ttl)
            ended = True
        except StoreError as exc:
            error = exc
        try:
            self._signal_end(claim, ABANDONED)
        except StoreError as exc:
            error = error or exc
        if not ended:
            try:
                self.store.delete(f"c/{claim.at}/{claim.gen}")
                ended = True
            except StoreError as exc:
                error = exc
        if ended:
            log.debug("released claim on %s (generation %d)", claim.at, claim.gen)
            return None
        return error

    def _signal_end(self, claim: Claim, signal: bytes) -> None:
        """Wake this claim's waiters with how it ended (the value, "published" or
        "abandoned"); no heartbeat follows."""
        with claim.lock:
            claim.ended = True
            slot = claim.beats + 1
        self.store.signal(f"w/{claim.at}/{claim.gen}/{slot}", signal, ttl=self.keys_ttl)

    def _delete(self, key: str, claim: Claim) -> None:
        try:
            self.store.delete(f"c/{claim.at}/{claim.gen}")
            self.store.delete(f"h/{claim.at}/{claim.gen}")
        except StoreError as exc:
            log.debug("could not delete claim on %s: %s", key, exc)


class Heartbeat:
    """The thread that bumps the heartbeat of every claim a process holds, every lease/4,
    and signals each beat to the claim's waiters (none after a claim's end signal); writes
    the job's liveness key every lease/8 while it holds claims; and retries releases left
    to it."""

    def __init__(self, claims: Claims, lease_s: float) -> None:
        self._claims = claims
        self._lease = lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rounds = 0

    def ensure_running(self) -> None:
        with self._claims.lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat_forever, name="coordinator-heartbeat", daemon=True)
            self._thread.start()

    def _beat_forever(self) -> None:
        while not self._stop.wait(self._lease / 8):
            self._rounds += 1
            self.beat_once(beat_claims=self._rounds % 2 == 0)

    def beat_once(self, *, beat_claims: bool = True) -> None:
        """One round: the liveness key, each held claim's beat (with ``beat_claims``), each
        pending release."""
        claims = self._claims
        with claims.lock:
            held = list(claims.held.values())
            pending = list(claims.releasing)
        if not held and not pending:
            return
        error: StoreError | None = None
        try:
            if held:
                claims.liveness.beat()
        except StoreError as exc:
            error = exc
        for claim in held if beat_claims else ():
            try:
                self._beat(claim)
            except StoreError as exc:
                error = error or exc
        for entry in pending:
            failed = claims.release(entry[0])
            if failed is None or time.monotonic() > entry[1]:
                with claims.lock:
                    claims.releasing.remove(entry)
            error = error or failed
        if error is not None:
            log.debug("heartbeat failed: %s", error)
            claims.on_error(error)
        else:
            claims.on_success()

    def _beat(self, claim: Claim) -> None:
        """Bump ``claim``'s heartbeat, signal it, extend the claim; each write is tried
        (a store that refuses writes still delivers the signal to subscribed waiters), and
        the first failure is raised after all of them."""
        claims, store = self._claims, self._claims.store
        at, gen = claim.at, claim.gen
        with claim.lock:  # no beat after the end signal
            if claim.ended:
                return
            claim.beats += 1
            beats = claim.beats
            writes = [lambda: store.set(f"h/{at}/{gen}", msgpack.packb([beats, time.time()]), ttl=claims.keys_ttl),
                      lambda: store.signal(f"w/{at}/{gen}/{beats}", BEAT, ttl=claims.keys_ttl)]
            if claims.claim_ttl is not None:  # the chain newcomers follow to this claim
                writes += [lambda g=g: store.expire(f"c/{at}/{g}", claims.claim_ttl) for g in range(gen + 1)]
            error: StoreError | None = None
            for write in writes:
                try:
                    write()
                except StoreError as exc:
                    error = error or exc
        if error is not None:
            raise error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._lease)
