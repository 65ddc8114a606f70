"""Split autotuning: the rank that selects a kernel hands its choices to the ranks that wait.

In max-autotune, Inductor picks each GEMM's kernel by compiling and timing about twenty
template choices, one after another, on the rank that lowers the graph. Under
``compile_once`` that is one rank, and every other rank waits on the store for the graph.
This module turns the waiting into work:

* The *selecting* rank publishes one **work item** per choice (:meth:`SplitTuning.select`):
  the choice's benchmark request (for a Triton template: its source and tensor shapes),
  pickled and sealed like any value. Choices that cannot travel (ATen kernels) are items
  only it runs.
* A rank waiting on the store (in a lookup, or on this node's lock) takes an item between
  two polls (:meth:`SplitTuning.help_once`): it claims it, compiles it, times it on its own
  GPU, and publishes the timing with its GPU's time for a reference kernel.
* The selecting rank claims and runs items too, from the front. When none is left
  unclaimed it runs the item another rank has held longest, once held for ``backup_after``
  (default 0: at once; the selecting rank has compiled every choice already, so running one
  costs it less than waiting would), so a slow or dead helper never holds it up; the first
  result published wins. It then
  publishes the merged timings once, each scaled by the ratio of its own reference time to
  the runner's (calibration across GPUs of one model), and Inductor picks from them.
  Every rank that ever selects among the same choices reads those merged timings, so every
  rank picks the same kernel.

Store keys, under ``<prefix>/tune/``::

    open/<n>        the n-th selection opened in this job (discovery by helpers)
    <sel>/items     the work items (sealed pickle; ``None`` for items only a selector runs)
    <sel>/c/<i>     claim on item i (created atomically; first wins)
    <sel>/r/<i>     item i's result: [ms or None, reference ms, rank] (first wins)
    <sel>/m         the merged timings (first wins)

Why no wait can form a cycle: a helper's item is a leaf (it compiles and times one
kernel on its own GPU; no lookup, no collective). A selecting rank never waits on a
helper for longer than ``backup_after`` (a bounded delay, not a dependency): it then runs
the item itself. Two ranks that
select the same choices share items and results, and each can finish alone. Timings on
one GPU take turns (``device_lock``), so concurrent ranks sharing a GPU do not disturb
each other's measurements; compiling is outside the lock. A store failure ends the
sharing: the selecting rank runs what is left itself, helpers stop helping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import msgpack

from coordinator.errors import IntegrityError, StoreError
from coordinator.integrity import open_sealed, seal
from coordinator.stores.base import Store

log = logging.getLogger(__name__)

_FIRST_POLL_S = 0.005
_MAX_POLL_S = 0.05


class Request(Protocol):
    """A choice's benchmark that can run in another process (pickled)."""

    def prepare(self) -> None:
        """Compile what :meth:`run` times (outside the device lock)."""

    def run(self) -> float:
        """Time the choice on this process's device; milliseconds (``inf``: unusable)."""


@dataclasses.dataclass
class WorkItem:
    """One choice of a selection."""

    name: str
    run_here: Callable[[], float]
    """Time the choice in this process (the selecting rank), with its own inputs."""
    request: Request | None = None
    """The same benchmark for another rank, or ``None`` if only a selecting rank can run it."""


@dataclasses.dataclass
class TuningCounts:
    """What split autotuning did on this rank."""

    selections: int = 0
    """Selections this rank made through the store."""
    selections_reused: int = 0
    """Selections whose merged timings another rank had already published."""
    items_run_here: int = 0
    """Items this rank ran for its own selections (backups included)."""
    items_received: int = 0
    """Items of this rank's selections that other ranks ran."""
    backups: int = 0
    """Items this rank re-ran because their holder was slow or gone."""
    items_run_for_others: int = 0
    """Items this rank ran while it waited, for another rank's selection."""
    blocked_s: float = 0.0
    """Seconds this rank's selections waited for other ranks' results."""


class DeviceLock:
    """One timing at a time on a device, across the processes of a node (``flock``)."""

    def __init__(self, name: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        self.path = os.path.join(tempfile.gettempdir(), "coordinator-device-locks", f"{safe}.lock")
        self.timeout = timeout.total_seconds()

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the lock; past ``timeout`` go on without it (a timing may be noisy, never stuck).
        Yields whether this process holds it."""
        with self._flock(self.timeout) as locked:
            if not locked:
                log.warning("device lock %s still held after %.0fs; timing without it", self.path, self.timeout)
            yield locked

    def tried(self) -> contextlib.AbstractContextManager[bool]:
        """Hold the lock if no other process does; yields whether this one holds it."""
        return self._flock(0.0)

    @contextlib.contextmanager
    def _flock(self, wait_s: float) -> Iterator[bool]:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a+") as f:
            deadline = time.monotonic() + wait_s
            delay = 0.001
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        locked = False
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
            try:
                yield locked
            finally:
                if locked:
                    fcntl.flock(f, fcntl.LOCK_UN)


class SplitTuning:
    """One process's side of split autotuning against one store."""

    def __init__(
        self,
        store: Store,
        *,
        prefix: str,
        rank: int,
        secret: bytes | None = None,
        device_lock: DeviceLock | None = None,
        reference_ms: Callable[[], float | None] = lambda: None,
        backup_after: timedelta = timedelta(0),
    ) -> None:
        self.store = store
        self.prefix = f"{prefix}/tune"
        self.rank = rank
        self.secret = secret
        self.device_lock = device_lock or DeviceLock("default")
        self._reference_ms = reference_ms
        self._reference: float | None | bool = False  # False: not measured yet
        self.backup_after = backup_after.total_seconds()
        self.counts = TuningCounts()
        self._broken = False
        self._seen = 0  # open/<n> entries read so far
        self._active: list[str] = []  # selections of other ranks this rank may help with
        self._items: dict[str, list[Request | None] | None] = {}
        self._next_item: dict[str, int] = {}  # helpers take items from the back
        self._helping = threading.Lock()
        self._running_s = 0.0  # time this rank's selections spent running items

    # -- shared ------------------------------------------------------------------------

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _fail(self, exc: StoreError) -> None:
        if not self._broken:
            self._broken = True
            log.warning("split autotuning: store failed (%s); tuning locally from now on", exc)

    def reference(self) -> float | None:
        """This process's time for the reference kernel (measured once, under the lock)."""
        if self._reference is False:
            try:
                with self.device_lock.held():
                    self._reference = self._reference_ms()
            except Exception:
                log.warning("split autotuning: reference timing failed; timings are not calibrated",
                            exc_info=True)
                self._reference = None
        return self._reference  # type: ignore[return-value]

    def _seal(self, key: str, payload: bytes) -> bytes:
        return seal(key, payload, secret=self.secret)

    def _open(self, key: str, blob: bytes) -> bytes:
        return open_sealed(key, blob, secret=self.secret).payload

    def _time(self, prepare: Callable[[], None] | None, run: Callable[[], float]) -> float:
        if prepare is not None:
            prepare()
        with self.device_lock.held():
            return float(run())

    def _put_result(self, selection: str, index: int, ms: float | None) -> None:
        key = self._key(selection, "r", index)
        record = msgpack.packb([ms, self.reference(), self.rank])
        self.store.add_if_absent(key, self._seal(key, record))

    def _read_result(self, selection: str, index: int) -> tuple[float | None, float | None, int] | None:
        key = self._key(selection, "r", index)
        blob = self.store.get(key)
        if blob is None:
            return None
        try:
            ms, reference, rank = msgpack.unpackb(self._open(key, blob))
        except IntegrityError as exc:
            log.warning("split autotuning: rejected result %s (%s); running it here", key, exc)
            return (None, None, -1)
        return ms, reference, rank

    # -- the selecting rank ------------------------------------------------------------

    def select(self, selection: str, items: Sequence[WorkItem]) -> list[float]:
        """Timings (ms) of ``items``, in order: the merged timings another rank published
        for ``selection``, or those of a selection this rank makes with the waiting ranks."""
        if self._broken:
            return [self._run_here(item) for item in items]
        started = time.monotonic()
        running = self._running_s
        results: dict[int, float] = {}
        try:
            merged = self._read_merged(selection, len(items))
            if merged is not None:
                self.counts.selections_reused += 1
                return merged
            self._open_selection(selection, items)
            references: dict[int, float | None] = {}
            first_seen_claimed: dict[int, float] = {}
            delay = _FIRST_POLL_S
            while len(results) < len(items):
                ran = False
                outstanding = []  # items another rank holds, oldest first
                for index in range(len(items)):
                    if index in results:
                        continue
                    found = self._read_result(selection, index)
                    if found is not None:
                        ms, reference, rank = found
                        if ms is None:  # the runner failed or the value was bad: run it here
                            results[index] = self._run_here(items[index])
                            ran = True
                            continue
                        results[index] = ms
                        references[index] = reference
                        if rank != self.rank:
                            self.counts.items_received += 1
                        continue
                    if self.store.add_if_absent(self._key(selection, "c", index),
                                                msgpack.packb([self.rank, time.time()])):
                        self._run_and_publish(selection, index, items[index], results, references)
                        ran = True
                        break
                    outstanding.append(index)
                    first_seen_claimed.setdefault(index, time.monotonic())
                if ran:
                    delay = _FIRST_POLL_S
                    continue
                if outstanding:
                    # Nothing left to claim: run the item held longest, if held past the backup delay.
                    index = min(outstanding, key=first_seen_claimed.__getitem__)
                    held = time.monotonic() - first_seen_claimed[index]
                    if held >= self.backup_after:
                        log.debug("split autotuning: %s item %d (%s) held by another rank for %.1fs; "
                                  "running it here", selection, index, items[index].name, held)
                        self.counts.backups += 1
                        self._run_and_publish(selection, index, items[index], results, references)
                        delay = _FIRST_POLL_S
                        continue
                    time.sleep(delay)
                    delay = min(delay * 1.5, _MAX_POLL_S)
            own = self.reference()
            timings = [
                self._calibrated(results[i], references.get(i, own), own) for i in range(len(items))
            ]
            key = self._key(selection, "m")
            self.store.add_if_absent(key, self._seal(key, msgpack.packb(timings)))
            final = self._read_merged(selection, len(items))
            self.counts.selections += 1
            return final if final is not None else timings
        except StoreError as exc:
            self._fail(exc)
            return [results[i] if i in results else self._run_here(item) for i, item in enumerate(items)]
        finally:
            elapsed = time.monotonic() - started
            blocked = elapsed - (self._running_s - running)
            self.counts.blocked_s += blocked
            log.debug("split autotuning: %s took %.2fs, %.2fs of it waiting for other ranks",
                      selection, elapsed, blocked)

    @staticmethod
    def _calibrated(ms: float, reference: float | None, own: float | None) -> float:
        if reference and own and ms != float("inf"):
            return ms * own / reference
        return ms

    def _run_here(self, item: WorkItem) -> float:
        self.counts.items_run_here += 1
        started = time.monotonic()
        try:
            return self._time(None, item.run_here)
        finally:
            self._running_s += time.monotonic() - started

    def _run_and_publish(self, selection: str, index: int, item: WorkItem, results: dict[int, float],
                         references: dict[int, float | None]) -> None:
        results[index] = ms = self._run_here(item)  # kept if the store fails below
        self._put_result(selection, index, ms)
        found = self._read_result(selection, index)  # first result wins
        if found is not None and found[0] is not None:
            results[index], references[index] = found[0], found[1]

    def _read_merged(self, selection: str, count: int) -> list[float] | None:
        key = self._key(selection, "m")
        blob = self.store.get(key)
        if blob is None:
            return None
        try:
            timings = msgpack.unpackb(self._open(key, blob))
        except IntegrityError as exc:
            log.warning("split autotuning: rejected merged timings %s (%s)", key, exc)
            return None
        if len(timings) != count:
            log.warning("split autotuning: merged timings %s have %d entries, expected %d; ignoring",
                        key, len(timings), count)
            return None
        return [float(ms) for ms in timings]

    def _open_selection(self, selection: str, items: Sequence[WorkItem]) -> None:
        key = self._key(selection, "items")
        requests = []
        for item in items:
            try:
                requests.append(pickle.dumps(item.request) if item.request is not None else None)
            except Exception as exc:  # an unpicklable request is run by selecting ranks only
                log.debug("split autotuning: %s cannot travel (%s)", item.name, exc)
                requests.append(None)
        if not self.store.add_if_absent(key, self._seal(key, msgpack.packb(requests, use_bin_type=True))):
            return  # another rank opened it: its items are the same choices
        n = self._seen
        while not self.store.add_if_absent(self._key("open", n), selection.encode()):
            n += 1
        log.debug("split autotuning: opened %s (%d items, %d can travel)", selection, len(items),
                  sum(r is not None for r in requests))

    # -- a waiting rank ----------------------------------------------------------------

    def help_once(self) -> bool:
        """Run one item of another rank's selection, if there is one. Called by a waiting
        rank between two polls; returns whether it ran one."""
        if self._broken or not self._helping.acquire(blocking=False):
            return False
        try:
            self._discover()
            for selection in list(self._active):
                if self._help_with(selection):
                    return True
            return False
        except StoreError as exc:
            self._fail(exc)
            return False
        finally:
            self._helping.release()

    def _discover(self) -> None:
        while True:
            raw = self.store.get(self._key("open", self._seen))
            if raw is None:
                return
            self._seen += 1
            self._active.append(raw.decode())

    def _requests(self, selection: str) -> list[Request | None] | None:
        if selection not in self._items:
            key = self._key(selection, "items")
            blob = self.store.get(key)
            if blob is None:
                return None
            try:
                packed = msgpack.unpackb(self._open(key, blob), raw=False)
                self._items[selection] = [pickle.loads(r) if r is not None else None for r in packed]
            except Exception as exc:  # a bad value is never run
                log.warning("split autotuning: rejected the items of %s (%s); not helping with it", selection, exc)
                self._items[selection] = None
        return self._items[selection]

    def _help_with(self, selection: str) -> bool:
        requests = self._requests(selection)
        if requests is None or self.store.get(self._key(selection, "m")) is not None:
            self._active.remove(selection)
            return False
        # Selecting ranks take items from the front; helpers from the back. A claimed
        # item stays claimed, so each helper scans each selection once.
        start = self._next_item.get(selection, len(requests) - 1)
        for index in range(start, -1, -1):
            self._next_item[selection] = index - 1
            request = requests[index]
            if request is None or self.store.get(self._key(selection, "c", index)) is not None:
                continue
            if not self.store.add_if_absent(self._key(selection, "c", index), msgpack.packb([self.rank, time.time()])):
                continue
            began = time.monotonic()
            try:
                ms: float | None = self._time(request.prepare, request.run)
                log.debug("split autotuning: ran item %d of %s for its selecting rank in %.2fs",
                          index, selection, time.monotonic() - began)
            except Exception as exc:
                log.warning("split autotuning: item %d of %s failed here (%s); its selecting rank runs it",
                            index, selection, exc)
                ms = None
            self._put_result(selection, index, ms)
            self.counts.items_run_for_others += 1
            return True
        self._active.remove(selection)  # every item is taken
        return False
