"""Taking and following claims: how a process asks a singleflight store for a key.

A lookup returns the published value, or claims the key (the caller computes it), or waits
while another process holds it (``coordinator.protocol.waiting``) and takes it over when the
claimant's lease lapses; ``coordinator.protocol.singleflight`` describes the protocol and
why its waits form no cycle. How a claim ends (published, dropped, handed off, abandoned) is
``coordinator.protocol.claims``'s alone: a lookup that claims a key whose value was published
meanwhile drops its claim there; the writes of a claimed value are
``coordinator.protocol.publishing``'s.

Every entry point answers at once with ``unavailable`` while the store is in its backoff
(``coordinator.protocol.health``), and records a store failure it meets, or the store's
answer, there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from coordinator.errors import StoreError
from coordinator.observe.trace import WAIT_ENDINGS, NoEvents, short_key
from coordinator.protocol.claims import Claims, latest_gen
from coordinator.protocol.health import StoreHealth
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.stores.base import Store
from coordinator.protocol.waiting import Waiter

_T = TypeVar("_T")


@dataclasses.dataclass(slots=True)
class LookupResult:
    """The outcome of a lookup: a value, or why there is none."""

    value: bytes | None
    outcome: Outcome
    waited_s: float = 0.0


def _unavailable() -> LookupResult:
    return LookupResult(None, Outcome.UNAVAILABLE)


@dataclasses.dataclass(eq=False)
class Lookups:
    """One process's lookups, offers and follows of keys in one store."""

    store: Store
    claims: Claims
    waiter: Waiter
    health: StoreHealth
    events: NoEvents
    #: ``describe(key)``: what this process computes for ``key``, in words, for the
    #: record of a claim it takes, unless the lookup says (``what=``).
    describe: Callable[[str], str] | None
    _thread: threading.local = dataclasses.field(default_factory=threading.local, init=False)

    def asked(self, ask: Callable[[], _T], unavailable: _T) -> _T:
        """``ask()``'s answer, or ``unavailable`` where the store is in its backoff or fails
        (recorded in the store's health)."""
        if not self.health.reachable():
            return unavailable
        try:
            answer = ask()
        except StoreError as exc:
            self.health.failed(exc)
            return unavailable
        self.health.answered()
        return answer

    # -- who may wait ---------------------------------------------------------------------

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

    def may_wait(self, *, leaf: bool = False) -> bool:
        """A rank holding a claim may try to claim more, but must not wait (no cycles),
        except for a ``leaf`` key: its owner computes it with no lookup of its own, so a
        wait for it ends when that computation does."""
        return (leaf or not self.claims.any()) and not getattr(self._thread, "no_waits", False)

    # -- the entry points -----------------------------------------------------------------

    def lookup(self, key: str, *, blocking: bool, before_waiting: Callable[[], bool] | None = None,
               rejected: bytes | None = None, what: str | None = None, leaf: bool = False) -> LookupResult:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.lookup`."""
        def ask() -> LookupResult:
            # A store that refuses writes is only read: a miss claims nothing (it may wait
            # for a claim another process holds, which thought it could publish).
            may_claim = self.health.writable()
            value = self.waiter.published(f"v/{key}", rejected)
            if value is not None:
                return LookupResult(value, Outcome.HIT)
            if not blocking:
                return LookupResult(None, Outcome.NONBLOCKING)
            return self._claim_or_wait(key, f"v/{key}", before_waiting, rejected, what, may_claim=may_claim,
                                       leaf=leaf)

        return self.asked(ask, _unavailable())

    def follow(self, key: str, *, grace_s: float = 0.0) -> LookupResult:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.follow`."""
        return self.asked(lambda: self._follow(key, grace_s), _unavailable())

    def offer(self, key: str, what: str | None = None) -> LookupResult:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.offer`."""
        def ask() -> LookupResult:
            if self.store.get(f"d/{key}") is not None:
                return LookupResult(None, Outcome.HIT)
            result = self._claim_or_wait(key, f"d/{key}", what=what, may_claim=self.health.writable())
            return LookupResult(None, result.outcome, result.waited_s)

        return self.asked(ask, _unavailable())

    # -- claiming and waiting ---------------------------------------------------------------

    def _follow(self, key: str, grace_s: float) -> LookupResult:
        published = f"v/{key}"
        value = self.store.get(published)
        if value is not None:
            return LookupResult(value, Outcome.HIT)
        if not self.may_wait():
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
        outcome, value = self._wait(key, key, latest_gen(self.store, key, 0), started, published, None)
        return LookupResult(value, outcome, time.monotonic() - started)

    def _claim_or_wait(self, key: str, published: str, before_waiting: Callable[[], bool] | None = None,
                       rejected: bytes | None = None, what: str | None = None, *,
                       may_claim: bool = True, leaf: bool = False) -> LookupResult:
        """Claim ``key``, or wait while another process holds it until store key
        ``published`` appears (returning its value), the claim is abandoned or expires
        (then try to claim the next generation), or the deadline passes. With
        ``rejected``, that value of ``published`` counts as absent, and the claim is the
        key's redo claim for it. ``what`` goes into the claim's record (default:
        ``describe(key)``). Without ``may_claim`` (the store refuses writes), a key nobody
        holds is ``nonblocking``: computed here, unclaimed. A thread that holds a claim or
        runs with ``no_waits`` does not wait: a key another process holds is ``nonblocking``;
        a ``leaf`` key is waited for even by a thread that holds claims (``may_wait``)."""
        may_wait = self.may_wait(leaf=leaf)
        at = key if rejected is None else f"{key}/redo-{hashlib.sha256(rejected).hexdigest()[:16]}"
        if what is None:
            what = self.describe(key) if self.describe is not None else ""
        started = time.monotonic()
        gen = 0
        while True:
            if not may_claim:
                if self.store.get(f"c/{at}/{gen}") is None:
                    return LookupResult(None, Outcome.NONBLOCKING)
            elif self.claims.take(key, gen, at, what):
                # Re-check: the value may have been published (and its claim deleted)
                # between our first read and the claim.
                value = self.waiter.published(published, rejected)
                if value is not None:
                    self.claims.drop(key)
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
            outcome, value = self._wait(key, at, gen, started, published, rejected)
            if outcome == Outcome.EXPIRED:
                gen += 1
                continue
            return LookupResult(value, outcome, time.monotonic() - started)

    def _wait(self, key: str, at: str, gen: int, started: float, published: str,
              rejected: bytes | None) -> tuple[Outcome, bytes | None]:
        """Wait on claim ``gen`` of ``at`` (``coordinator.protocol.waiting``), traced as a span."""
        wait_began = time.time()
        outcome, value, owner_rank = self.waiter.wait(at, gen, started, published, rejected)
        self.events.span("wait", wait_began, key=short_key(key), owner=owner_rank, ended=WAIT_ENDINGS[outcome])
        return outcome, value

    def _work_first(self, work: Callable[[], bool], published: str, rejected: bytes | None) -> bytes | None:
        """Run ``work`` until it has nothing left or store key ``published`` appears."""
        while work():
            value = self.waiter.published(published, rejected)
            if value is not None:
                return value
        return None
