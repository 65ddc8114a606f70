"""Backward graphs compiled early, by the ranks that wait.

AOTAutograd compiles a graph's backward at its first backward call, so a job's backward
graphs are compiled one after another, after the forward pass, on the rank that gets to
each first; the other ranks wait for it. Yet each backward is fully known as soon as its
forward is compiled (or loaded): ``_compat.deferred_backwards`` reports it then.

A rank that waits for an FX graph another rank compiles (the next forward graph, most
often: DDP splits a model into one graph per bucket) spends the wait compiling the
backward graphs it already knows, oldest first, instead of idling. Each early compile
is an ordinary claimed compile: its FX lookup claims the graph's key when no rank has it
and none is compiling it, and the entry is published as any other; when a rank has the
graph or is compiling it, the lookup stops the early compile (``SkipCompile``) and
nothing waits. When the training step reaches the backward, AOTAutograd's own compile
finds the graph in the local cache or the store.

One early compile at a time per device (a node-wide lock on the device's name, tried,
never waited for): the rank that compiles the graph others wait for keeps most of the
host's cores, and a GPU that ranks share is not timed by three compiles at once.

Why no wait cycle forms: an early compile runs only inside a wait for an FX graph, and
waits on nothing itself: its lookups never block (``EarlyBackwards._early_compile``), and a rank
inside it holds only the claim of the graph it compiles, which it finishes without any
collective. The wait it runs in resumes when it returns; a heartbeat seen during the
compile keeps the waited-for claim's lease alive, as before.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.observe.stats import Counts
from coordinator.protocol.node import DeviceLock
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import LookupResult, Singleflight

#: The kind whose waits an early compile fills, and whose lookups it makes.
KIND = "fx_graph"

log = logging.getLogger(__name__)


class EarlyBackwardCounts(Counts, compiled=0, skipped=0, failed=0, seconds=0.0):
    """What one rank's early backward compiles did: backward graphs this rank ``compiled``
    while it waited; early compiles ``skipped`` because a rank had the graph or was compiling
    it (or this rank's local cache had it); early compiles that ``failed`` (raised: the first
    backward call compiles the graph again); the ``seconds`` spent in early compiles."""

    line = ("backward graphs compiled early while waiting: {compiled} ({seconds:.1f}s), {skipped} left to other "
            "ranks, {failed} failed")
    shown_if = ("compiled", "skipped", "failed")


class EarlyBackwards(Feature, counts=EarlyBackwardCounts):
    """The backward graphs this process knows of and has not tried to compile early."""

    name = "early_backward"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._events = context.events
        self._lock_for_device: DeviceLock | None = None
        self._pending: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._running = threading.local()

    def enabled(self, routed: frozenset[str]) -> bool:
        return self.context.config.early_backward and KIND in routed

    def claims(self) -> list[str] | None:
        """The keys claimed by the early compile running on this thread (``None``: none runs)."""
        return getattr(self._running, "claims", None)

    def forbids_waits(self) -> bool:
        return self.claims() is not None

    def work_while_waiting(self, kind: str) -> Callable[[], bool] | None:
        return self.help_once if kind == KIND else None

    def looked_up(self, flight: Singleflight, kind: str, key: str, result: LookupResult,
                  rejected: bytes | None) -> LookupResult:
        """An early compile goes on only for a graph it claimed; one that a rank has, or
        is compiling, is loaded when the backward pass needs it."""
        if kind == KIND and self.claims() is not None and result.outcome != Outcome.CLAIMED:
            raise _compat.SkipCompile(f"FX graph {key}: {result.outcome}")
        return result

    def backward_deferred(self, backward: Any) -> bool:
        self.add(backward)
        return True

    @contextlib.contextmanager
    def _early_compile(self) -> Iterator[list[str]]:
        """A backward graph compiled early, inside a wait on this thread: its lookups never
        wait, an FX lookup that does not claim stops it (``SkipCompile``), and the claims it
        leaves unpublished are released when it ends. Yields the list of keys it claims."""
        flight = self.context.flight()
        if flight is None:
            raise _compat.SkipCompile("no store")
        self._running.claims = claims = []
        try:
            with flight.no_waits():
                yield claims
        finally:
            self._running.claims = None
            for key in claims:
                flight.abandon(key)  # a no-op for a key it published

    def add(self, backward: Any) -> None:
        """A backward AOTAutograd deferred (``_compat.deferred_backwards`` reports it)."""
        with self._lock:
            self._pending.append(backward)

    def help_once(self) -> bool:
        """Compile the oldest pending backward; returns whether there was one to try."""
        if getattr(self._running, "active", False):  # a lookup inside an early compile
            return False
        with self._lock:
            if not self._pending:
                return False
        if self._lock_for_device is None:
            self._lock_for_device = DeviceLock(f"early-backward-{_compat.device_name()}")
        with self._lock_for_device.tried() as mine:
            if not mine:  # another rank compiles early on this device: leave the cores to the graph waited for
                return False
            backward = self._take()
            if backward is None:
                return False
            self._compile(backward)
            return True

    def _take(self) -> Any:
        """The oldest pending backward that the backward pass is not compiling right now
        (those are dropped: they are no longer early)."""
        with self._lock:
            for backward in list(self._pending):
                if backward.compiling_now():
                    self._pending.remove(backward)
            return self._pending.popleft() if self._pending else None

    def _compile(self, backward: Any) -> None:
        self._running.active = True
        started, began = time.monotonic(), time.time()
        outcome = "failed"
        try:
            with self._early_compile() as claims:
                backward.compile()
            outcome = "compiled" if claims else "skipped"
            if claims:
                self.counts.compiled += 1
                log.debug("compile_once: compiled a backward graph early, while waiting (%.1fs)",
                         time.monotonic() - started)
            else:  # loaded from this rank's own local cache: nothing to compile
                self.counts.skipped += 1
        except Exception as exc:
            if _compat.is_skip(exc):
                outcome = "skipped"
                self.counts.skipped += 1
            else:
                self.counts.failed += 1
                log.warning("compile_once: compiling a backward graph early failed; the backward pass will "
                            "compile it", exc_info=True)
        finally:
            self._running.active = False
            self.counts.seconds += time.monotonic() - started
            self._events.span("early backward", began, outcome=outcome)

