"""The claims one process holds in a singleflight store, and the heartbeat that keeps them.

A claim is ``c/<at>/<gen>`` (created atomically), with its heartbeat ``h/<at>/<gen>``
and its signals ``w/<at>/<gen>/<n>``: ``at`` is the key, or its redo name
(``coordinator.protocol.singleflight`` describes the protocol).

A claim's record is a msgpack map (:func:`claim_record` reads it): ``rank``, ``host`` and
``pid`` of its claimant, ``t`` the time it was taken, and ``what``: what the claimant
computes, in words (``"backward graph 1 of 'forward' (compile 0/0)"``), which a waiting
rank's lines name. Records of earlier versions are a list ``[rank, host, pid, t]``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import msgpack

from coordinator.errors import StoreError
from coordinator.protocol.stores.base import Store

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
        fields = claim_record(record)
        return cls(fields["rank"], fields["host"], fields["pid"])

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
    """The claims this process holds in one store (by key), their creation, end signal
    and deletion, and the heartbeat that keeps them alive."""

    def __init__(self, store: Store, owner: Owner, lease_s: float) -> None:
        self.store = store
        self.owner = owner
        self.held: dict[str, Claim] = {}
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
        """Create claim ``c/<at>/<gen>`` for ``key``; ``what`` says what this process
        computes for it, in words."""
        fields = {"rank": self.owner.rank, "host": self.owner.host, "pid": self.owner.pid, "t": time.time()}
        if what:
            fields["what"] = what
        record = msgpack.packb(fields)
        if not self.store.add_if_absent(f"c/{at}/{gen}", record, ttl=_CLAIM_TTL):
            return False
        with self.lock:
            self.held[key] = Claim(gen, time.time(), at)
        self.store.set(f"h/{at}/{gen}", msgpack.packb([0, time.time()]))
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
            self.store.signal(f"w/{at}/{gen}/{n}", MOVED)

    def signal_end(self, claim: Claim, signal: bytes) -> None:
        """Wake this claim's waiters with how it ended (the value, "published" or
        "abandoned"); no heartbeat follows."""
        with claim.lock:
            claim.ended = True
            slot = claim.beats + 1
        self.store.signal(f"w/{claim.at}/{claim.gen}/{slot}", signal)

    def abandon(self, claim: Claim) -> None:
        """Mark ``claim`` abandoned and wake its waiters."""
        self.store.set(f"a/{claim.at}/{claim.gen}", msgpack.packb(time.time()))
        self.signal_end(claim, ABANDONED)
        log.debug("abandoned claim on %s (generation %d)", claim.at, claim.gen)

    def drop(self, key: str) -> None:
        """Release a claim whose value another process published meanwhile."""
        claim = self.pop(key)
        if claim is None:
            return
        try:
            self.signal_end(claim, PUBLISHED)
        except StoreError as exc:
            log.debug("could not signal the end of claim on %s: %s", key, exc)
        self.delete(key, claim)

    def delete(self, key: str, claim: Claim) -> None:
        try:
            self.store.delete(f"c/{claim.at}/{claim.gen}")
            self.store.delete(f"h/{claim.at}/{claim.gen}")
        except StoreError as exc:
            log.debug("could not delete claim on %s: %s", key, exc)


class Heartbeat:
    """The thread that bumps the heartbeat of every claim a process holds, every lease/4,
    and signals each beat to the claim's waiters; none after a claim's end signal."""

    def __init__(self, claims: Claims, lease_s: float) -> None:
        self._claims = claims
        self._lease = lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_running(self) -> None:
        with self._claims.lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat_forever, name="coordinator-heartbeat", daemon=True)
            self._thread.start()

    def _beat_forever(self) -> None:
        claims, store = self._claims, self._claims.store
        while not self._stop.wait(self._lease / 4):
            with claims.lock:
                held = list(claims.held.items())
            for key, claim in held:
                try:
                    with claim.lock:  # no beat after the end signal
                        if claim.ended:
                            continue
                        claim.beats += 1
                        store.set(f"h/{claim.at}/{claim.gen}", msgpack.packb([claim.beats, time.time()]))
                        store.signal(f"w/{claim.at}/{claim.gen}/{claim.beats}", BEAT)
                except StoreError as exc:
                    log.debug("heartbeat for %s failed: %s", key, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._lease)
