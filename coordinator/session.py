"""One rank's coordinator session: what Inductor's cache backends call into.

A :class:`Session` routes Inductor cache reads and writes (:meth:`Session.get`,
:meth:`Session.put`) to singleflight lookups and publishes: the node's copy first
(``coordinator.protocol.node``), every value sealed (``coordinator.protocol.integrity``),
the kernels that travel with entries (``coordinator.features.artifacts``). What differs per
cache kind is in the kind's record (``_compat.KINDS``); what a compile feature adds
(``coordinator.features``) it adds through the fixed points of a lookup that
:class:`~coordinator.features.base.Feature` names, given a
:class:`~coordinator.features.base.Context` of its ``Session``, which names neither.

Its features start by part (``coordinator.starts``): nothing at all until the first sign
of a compile. It opens its store lazily, at the first cache access: the training script
usually enters ``compile_once`` before or right after ``init_process_group``, and the
default store exists only after it. A value that fails verification is never unpickled:
it counts as missing, one rank compiles it again and the others wait for that
(``Singleflight.lookup``'s ``rejected``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from coordinator import _compat
from coordinator import features as feature_registry
from coordinator.errors import ConfigError, IntegrityError, StoreError
from coordinator.features import Context, Feature, Part
from coordinator.features.artifacts import ShippedKernels
from coordinator.observe.stats import Stats
from coordinator.observe.trace import open_events, short_key
from coordinator.protocol.devices import DeviceIndices
from coordinator.protocol.fingerprint import key_prefix
from coordinator.protocol.health import FIRST_RETRY_S, LAST_RETRY_S
from coordinator.protocol.integrity import Sealed, open_sealed, seal
from coordinator.protocol.liveness import this_job
from coordinator.protocol.node import NodeCache
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import LookupResult, Owner, Singleflight
from coordinator.protocol.stores import open_store
from coordinator.protocol.stores.base import TimedStore
from coordinator.protocol.writer import BackgroundWriter
from coordinator.settings import MIN_SECRET_BYTES, Config

log = logging.getLogger(__name__)

#: Where a hit's value came from, as its ``receive`` event says (else ``store``).
_SOURCES = {Outcome.NODE: "node", Outcome.PREPARED: "prefetch"}

_TIME_TAKEN = re.compile(rb'"time_taken_ms":\s*(\d+)')

_F = TypeVar("_F", bound=Feature)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class Session:
    """Routes one process's Inductor cache traffic through a shared store.

    Its features start by part (``Feature.part``): :meth:`enable` turns a part's features on
    (the core's first); ``coordinator.starts`` calls it at the first sign that a part is
    needed, and installs the part's hooks. A session built with ``parts`` has those on from
    the start (the default, for a session used directly: every part). Its first lookup or
    publish turns the core on, whatever started first.
    """

    def __init__(self, config: Config, *, parts: tuple[Part, ...] = tuple(Part)) -> None:
        self.config = config
        self.stats = Stats(_current_rank())
        self.stats.store = _store_name(config.store)
        self.events = open_events(config.trace_dir, lambda: self.stats.rank, self.stats.count)
        self._flight: Singleflight | None = None
        self._open_lock = threading.Lock()
        self._told_no_store = False
        self._unusable = False
        self._open_again_at = 0.0  # a store that fails to open is tried again, with backoff
        self._open_delay = FIRST_RETRY_S
        self._prefix = ""
        self._node: NodeCache | None = None
        self._devices: DeviceIndices | None = None
        self.kernels = ShippedKernels(_compat.inductor_cache_dir, _compat.triton_cache_dir, _cuda,
                                      _compat.isa_probe_libraries)
        self._routed: frozenset[str] | None = None
        context = Context(config=config, events=self.events, stats=self.stats, kernels=self.kernels,
                          flight=self.flight, store_key=self.store_key, lookup=self._lookup, publish=self.publish,
                          verify=self._verified, feature=self.feature, peers=self.peers, get=self.get, put=self.put)
        #: Every listed feature, built (a constructor starts nothing), in the registry's order.
        self._built: list[Feature] = [feature(context) for feature in feature_registry.FEATURES]
        #: The compile features this ``Session`` runs, in the registry's order: those of the
        #: parts started so far that are on. Replaced, never changed in place: a lookup
        #: iterates it while another thread starts a part.
        self.features: list[Feature] = []
        self.stats.features = {feature.name: None for feature in self._built if feature.counts is not None}
        self._parts: set[Part] = set()
        self._enabling = threading.RLock()
        self._when_started: list[Callable[[], None]] = []
        for part in parts:
            self.enable(part)

    @property
    def routed(self) -> frozenset[str]:
        """The cache kinds this ``Session`` routes (asked once: on a GPU host it asks CUDA)."""
        if self._routed is None:
            self._routed = frozenset(_compat.routable_kinds(self.config.caches))
        return self._routed

    @property
    def started(self) -> bool:
        """Whether its core has started: a compile began, or a lookup came (a process that
        compiled nothing: ``False``)."""
        return Part.CORE in self._parts

    def when_started(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the core starts (now, if it has)."""
        with self._enabling:
            if not self.started:
                self._when_started.append(callback)
                return
        callback()

    def enable(self, part: Part) -> list[Feature]:
        """Turn on the features of ``part`` that are on (``Feature.enabled``), the core's
        first, once; returns those of ``part`` it turned on now. The core's have no hooks and
        are started here (``Feature.started``); for another part the caller installs their
        hooks (``Feature.hooks``), then starts them."""
        if part in self._parts:
            return []
        with self._enabling:
            if part in self._parts:
                return []
            if part is Part.COMPILE:
                self.enable(Part.CORE)  # its lookups come within seconds: fetch ahead from now
            routed = self.routed if part is Part.COMPILE else frozenset()
            on = [feature for feature in self._built if feature.part is part and feature.enabled(routed)]
            self.features = [feature for feature in self._built if feature in self.features or feature in on]
            for feature in on:
                if feature.counts is not None:
                    self.stats.features[feature.name] = feature.counts
            self._parts.add(part)
            if part is Part.CORE:
                for start in [feature.started for feature in on] + self._when_started:
                    try:
                        start()
                    except Exception:  # the lookups go on without what did not start
                        log.warning("compile_once: %s did not start", getattr(start, "__qualname__", start),
                                    exc_info=True)
                self._when_started.clear()
            return on

    def feature(self, cls: type[_F]) -> _F | None:
        """The instance of feature ``cls``, if it is on."""
        return next((feature for feature in self.features if isinstance(feature, cls)), None)

    # -- store -------------------------------------------------------------------------

    def flight(self) -> Singleflight | None:
        """The singleflight client, opened on first use; ``None`` while no store exists."""
        if self._flight is not None or self._unusable or time.monotonic() < self._open_again_at:
            return self._flight
        with self._open_lock:
            if self._flight is None:
                self._flight = self._open()
        return self._flight

    def _open(self) -> Singleflight | None:
        try:
            store = TimedStore(open_store(self.config.store, chunk_bytes=self.config.chunk_bytes),
                               self.stats.record_store_call)
        except (ConfigError, StoreError) as exc:
            if isinstance(exc, StoreError) and self.config.store is None:
                # The job's store comes with init_process_group: until then, local compiles.
                if not self._told_no_store:
                    log.info("compile_once: no store yet (%s); compiling locally until there is one", exc)
                    self._told_no_store = True
                return None
            if self._open_delay == FIRST_RETRY_S:
                log.warning("compile_once: cannot open the store (%s); compiling locally%s", exc,
                            "" if isinstance(exc, ConfigError) else ", trying again later")
                self.events.instant("store lost", error=str(exc))
            # A store that can never be opened is not tried again; another one after a backoff.
            self._unusable = isinstance(exc, ConfigError)
            self._open_again_at = time.monotonic() + self._open_delay
            self._open_delay = min(self._open_delay * 2, LAST_RETRY_S)
            return None
        rank = _current_rank()
        self.stats.rank, self.stats.store = rank, store.name
        self._node = NodeCache(_compat.inductor_cache_dir(), self.events)
        self._prefix = key_prefix(self.config.store_secret, self.config.namespace)
        if self.config.store_secret is None:
            _say_unsigned_once(store.name)
        job = this_job()
        self._devices = DeviceIndices(store, self._prefix, job, rank)
        self._devices.publish()
        writer = None
        if self.config.publish_queue_mb:
            writer = BackgroundWriter("publishing", self.config.publish_queue_mb * 2**20,
                                      progress_interval=self.config.progress_interval)
        self.stats.writer = writer
        return Singleflight(store, owner=Owner.this_process(rank, job), lease=self.config.lease,
                            wait_timeout=self.config.wait_timeout, progress_interval=self.config.progress_interval,
                            signalled_waits=self.config.signalled_waits, events=self.events,
                            describe=self.describe, writer=writer)

    def peers(self, world: int, wait_s: float) -> list[int]:
        """The ranks of a job of ``world`` ranks that compile for this rank's device index,
        and so can share its graphs (``protocol.devices``); all of them before the store opens."""
        if self._devices is None:
            return list(range(world))
        return self._devices.peers(world, wait_s)

    @staticmethod
    def describe(key: str) -> str:
        """What this thread computes for store key ``key``, in words, for the record of a
        claim on it (a waiting rank names it): the graph this thread compiles
        (``_compat.compiling_now``), or what the key's cache kind holds."""
        now = _compat.compiling_now()
        kind = _compat.KINDS.get(short_key(key).split("/", 1)[0])
        if kind is None:
            return now
        if kind.graphs and now:
            return now
        noun = kind.described_as or f"a {kind.name} entry"
        return f"{noun} in {now}" if now else noun

    def store_key(self, kind: str, inductor_key: str) -> str:
        """The store key of Inductor's ``inductor_key`` of cache ``kind``."""
        digest = hashlib.sha256(inductor_key.encode()).hexdigest()[:40]
        return f"{self._prefix}/{kind}/{digest}"

    def _lookup(self, flight: Singleflight, kind: str, key: str, rejected: bytes | None = None) -> LookupResult:
        """Look ``key`` up once per node (``NodeCache.lookup``), blocking as its kind and
        the features allow. A rank that holds a claim, or runs a compile that must not
        wait, does not wait; a waiting rank first does the features' work. With
        ``rejected`` (a value of ``key`` that failed verification) the store is asked
        again, that value counting as missing: one rank claims the key and compiles it,
        the others wait for it."""
        record = _compat.KINDS[kind]
        # A leaf key's owner waits on nothing while it holds it: even a claim holder waits for it.
        holds_claims = flight.holds_claims() and not record.leaf
        claim_lists = [claims for feature in self.features if (claims := feature.claims()) is not None]
        blocking = record.waits == _compat.WaitRule.ALWAYS or any(feature.lets_wait(kind) for feature in self.features)
        if record.inside_aot_entries and _compat.in_aot_entry_load():
            blocking = False  # a miss compiles nothing here: no claim (docs/design.md, rule 1)
        forbidden = any(feature.forbids_waits() for feature in self.features)
        may_wait = not holds_claims and not forbidden
        work_first = next((work for feature in self.features
                           if (work := feature.work_while_waiting(kind)) is not None), None)
        if rejected is None and not forbidden:
            # A wait for this process's own prefetch waits on no rank; a claim holder does not
            # make the ranks that wait on it wait longer for it.
            wait = not holds_claims
            prepared = next((value for feature in self.features
                             if (value := feature.prepared(key, wait=wait)) is not None), None)
            if prepared is not None:  # fetched ahead: no store request, no node lock, no claim
                return LookupResult(prepared, Outcome.PREPARED)
        if rejected is not None:
            self._node.forget(key, rejected)
            result = flight.lookup(key, blocking=blocking, rejected=rejected, leaf=record.leaf)
            if result.value is not None:
                self._node.write(key, result.value)
        else:
            result = self._node.lookup(flight, key, blocking=blocking, work_first=work_first, leaf=record.leaf,
                                       wait_s=self.config.wait_timeout.total_seconds() if may_wait else None)
        if result.outcome != Outcome.NODE and result.value is not None:
            self.stats.record_store_fetch()
        if result.outcome == Outcome.CLAIMED:
            self.events.instant("claim", key=short_key(key))
            for claims in claim_lists:
                claims.append(key)
        return result

    def backward_deferred(self, backward: _compat.DeferredBackward) -> None:
        """A backward AOTAutograd deferred: the first feature that takes it has it."""
        any(feature.backward_deferred(backward) for feature in self.features)

    def _missed(self, kind: str, key: str, inductor_key: str) -> None:
        self.stats.record_miss(kind)
        if _compat.KINDS[kind].inside_aot_entries and _compat.in_aot_entry_load():
            return  # AOTAutograd compiles the graph afresh, and looks it up again then
        # When this rank compiles a graph it did not claim (the store failed, or it held
        # another claim), kernels written since the miss travel with the entry.
        if _compat.ships_kernels(kind):
            self.kernels.missed(key)
        for feature in self.features:
            feature.missed(kind, key, inductor_key)
        self.events.compile_began(key)

    # -- the two calls Inductor makes ----------------------------------------------------

    def get(self, kind: str, inductor_key: str) -> bytes | None:
        """Return the payload for ``inductor_key`` or ``None`` (Inductor then compiles)."""
        self.enable(Part.CORE)
        flight = self.flight()
        key = self.store_key(kind, inductor_key)
        if flight is None:  # no store: Inductor compiles, and this rank's counts and features say so
            self.stats.record_miss(kind)
            if not (_compat.KINDS[kind].inside_aot_entries and _compat.in_aot_entry_load()):
                for feature in self.features:
                    feature.missed(kind, key, inductor_key)
                self.events.compile_began(key)
            return None
        began = time.time()
        result = self._lookup_once(flight, kind, key)
        sealed = self._verified(kind, key, result.value) if result.value is not None else None
        if result.value is not None and sealed is None:
            # Refused: one rank compiles it again, the others wait for that; a value that
            # fails again is compiled here, with no more waiting.
            rejected = result.value
            result = self._lookup_once(flight, kind, key, rejected)
            sealed = self._verified(kind, key, result.value) if result.value is not None else None
            if result.value is not None and sealed is None:
                result = dataclasses.replace(result, value=None, outcome=Outcome.REJECTED)
        for feature in self.features:
            feature.asked(kind, inductor_key)
        if sealed is None:
            log.debug("compile_once: %s miss %s (%s)", kind, key, result.outcome)
            self._missed(kind, key, inductor_key)
            return None
        if not all(feature.accepts(kind, key, sealed.meta) for feature in self.features):
            self._missed(kind, key, inductor_key)
            return None
        self._received(kind, key, sealed, len(result.value), source=_SOURCES.get(result.outcome, "store"),
                       began=began)
        return sealed.payload

    def _lookup_once(self, flight: Singleflight, kind: str, key: str, rejected: bytes | None = None) -> LookupResult:
        """One lookup, as each feature sees it after it (``Feature.looked_up``)."""
        result = self._lookup(flight, kind, key, rejected)
        for feature in self.features:
            result = feature.looked_up(flight, kind, key, result, rejected)
        return result

    def _verified(self, kind: str, key: str, value: bytes) -> Sealed | None:
        """``value`` opened and verified, or ``None`` (logged) if it fails any check."""
        try:
            return open_sealed(key, value, secret=self.config.store_secret)
        except IntegrityError as exc:
            log.warning("compile_once: rejected %s entry %s from the store: %s", kind, key, exc)
            self.events.instant("rejected", key=short_key(key), why=str(exc))
            return None

    def _received(self, kind: str, key: str, sealed, nbytes: int, *, source: str, began: float) -> None:
        """Write a hit's kernels, extend NCCL timeouts by the compile time its entry records,
        count it (and that time as saved, for a kind whose hit saves it:
        ``_compat.hit_saves_compile``)."""
        written = 0
        try:
            written = self.kernels.emit(sealed.files) if sealed.files else 0
        except OSError as exc:
            log.warning("compile_once: could not write received kernels (%s); Inductor will compile them", exc)
        recorded_s = sealed.meta.get("time_taken_ms", 0) / 1000.0
        self.kernels.record(kind, sealed.files, recorded_s)
        if _compat.KINDS[kind].inductor_extends_timeout:
            # Inductor extends by the entry's recorded compile time itself on this hit.
            extension = float(int(recorded_s)) if _compat.has_nccl_process_group() else 0.0
        else:
            extension = _compat.extend_nccl_timeouts(recorded_s)
        saved = {"saved_s": round(recorded_s, 3)} if _compat.hit_saves_compile(kind) else {}
        self.events.span("receive", began, key=short_key(key), bytes=nbytes, kernels=written,
                         **saved, **{"from": source})
        if extension:
            self.events.instant("timeout extension", seconds=extension)

    def put(self, kind: str, inductor_key: str, data: bytes, meta: dict | None = None) -> None:
        """Publish Inductor's freshly computed entry to the other ranks (``meta``: more of
        the entry's metadata, such as the compile time it records, ``time_taken_ms``)."""
        self.enable(Part.CORE)
        flight = self.flight()  # first: opening the store names the keys' prefix
        key = self.store_key(kind, inductor_key)
        self.events.compile_ended(key)
        if flight is None:
            return
        if any(feature.publishes(flight, kind, key, data) for feature in self.features):
            return  # a feature publishes it (later, or as something else)
        files: dict[str, bytes] = {}
        if _compat.ships_kernels(kind) and self.config.ship_cpu_kernels:
            files = self.kernels.built_for(key, flight.claim_started(key))
        else:
            self.kernels.forget(key)
        self.publish(flight, kind, key, data, files, meta)

    def publish(self, flight: Singleflight, kind: str, key: str, data: bytes, files: dict[str, bytes],
                extra_meta: dict | None = None, *, local_copy: bool = False) -> bool:
        """Seal ``data`` (and ``files``) under ``key``, keep it on this node, publish it:
        behind the compile (``Singleflight.publish_behind``), in the order entries come.
        ``local_copy``: the value is this rank's local cache entry of a graph (``local_hits``).

        Returns:
            False if it will not be published (the writer's queue is full).
        """
        match = _TIME_TAKEN.search(data[-256:])
        meta = {"time_taken_ms": int(match.group(1)) if match else 0, "rank": flight.owner.rank,
                "host": flight.owner.host, **(extra_meta or {})}
        self.kernels.record(kind, files, meta["time_taken_ms"] / 1000.0)
        node = self._node

        def sealed() -> bytes:
            blob = seal(key, data, meta=meta, files=files, secret=self.config.store_secret)
            try:
                node.write(key, blob)  # local ranks read it from disk, not the store
            except OSError as exc:
                log.debug("could not keep %s on this node: %s", key, exc)
            return blob

        def published(ok: bool, blob: bytes) -> None:
            extra = {"local_copy": True} if local_copy else {}
            self.events.instant("publish", key=short_key(key), bytes=len(blob), ok=ok, **extra)
            for feature in self.features:
                feature.published(kind, key, blob)

        nbytes = len(data) + sum(len(content) for content in files.values())
        return flight.publish_behind(key, sealed, nbytes=nbytes, what=f"{kind} entry {short_key(key)}",
                                     published=published)

    def compile_ended(self) -> None:
        """An outermost compile finished: the features hear of it first; then the claims it
        did not publish are released, and the spans of the graphs it compiled without an
        entry end."""
        for feature in self.features:
            feature.compile_ended()
        for kind in self.routed:
            if _compat.CACHE_KINDS[kind].saved_by_its_compile:
                self.events.compiles_ended(kind)
        if self._flight is not None:  # Inductor's claims only: other threads' Triton compiles release their own
            prefixes = tuple(f"{self._prefix}/{kind}/" for kind in self.routed)
            released = self._flight.abandon_all(lambda key: key.startswith(prefixes))
            if released:
                log.debug("compile_once: released %d unpublished claims", released)

    def close(self) -> None:
        """Let the entries still being published finish (up to ``drain_timeout``), let the
        features finish (they hear of each publish), then release what this ``Session`` holds."""
        if self._flight is not None:
            self._flight.drain(self.config.drain_timeout)
        for feature in self.features:
            feature.close()
        if self._flight is not None:
            self._flight.close()
        self.events.compiles_ended()
        self.events.close()


_told_unsigned = threading.Event()


def _say_unsigned_once(store: str) -> None:
    """Say once per process that the store's values are checked but not authenticated."""
    if not _told_unsigned.is_set():
        _told_unsigned.set()
        log.info("compile_once: values in the %s store are checksummed but not authenticated (anyone who can "
                 "write to it can make the ranks load native code); set COORDINATOR_SECRET (%d bytes or more, "
                 "the same on every rank) to sign them", store, MIN_SECRET_BYTES)


def _store_name(store: Any) -> str:
    """The configured store's kind as the summary names it, before it is opened."""
    if isinstance(store, str):
        return store.split("://", 1)[0]
    return getattr(store, "name", None) or "c10d"
