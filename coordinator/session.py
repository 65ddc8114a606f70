"""One rank's coordinator session: what Inductor's cache backends call into.

A :class:`Session` routes Inductor cache reads and writes (:meth:`Session.get`,
:meth:`Session.put`) to singleflight lookups and publishes, and each concept to its
module: the node's copy (``coordinator.protocol.node``), sealing (``coordinator.protocol.integrity``),
kernels that travel with entries (``coordinator.features.artifacts``), graphs whose code depends
on the rank (``coordinator.features.rank_dependence``), local hits shared with cold ranks
(``coordinator.features.local_hits``), backward graphs compiled early (``coordinator.features.early_backward``),
and the rules of each cache kind (``_compat.CACHE_KINDS``). It opens its store lazily, at
the first cache access: the training script usually enters ``compile_once`` before or
right after ``init_process_group``, and the default store exists only after it. A value
that fails verification is never unpickled: it counts as missing, one rank compiles it
again and the others wait for that (``Singleflight.lookup``'s ``rejected``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from typing import Any

from coordinator import _compat
from coordinator.errors import ConfigError, IntegrityError, StoreError
from coordinator.features.artifacts import ShippedKernels
from coordinator.features.early_backward import EarlyBackwards
from coordinator.features.rank_dependence import RankDependence
from coordinator.features.split_shares import SplitShares
from coordinator.features.tuning_steps import TuningSteps
from coordinator.observe.stats import Stats
from coordinator.observe.trace import open_events, short_key
from coordinator.protocol.fingerprint import key_prefix, warn_if_device_indices_differ
from coordinator.protocol.integrity import open_sealed, seal
from coordinator.protocol.node import NodeCache
from coordinator.protocol.singleflight import LookupResult, Owner, Singleflight
from coordinator.protocol.stores import open_store
from coordinator.protocol.stores.base import TimedStore
from coordinator.settings import Config

log = logging.getLogger(__name__)

_TIME_TAKEN = re.compile(rb'"time_taken_ms":\s*(\d+)')

_active: Session | None = None
_last: Session | None = None


def active() -> Session | None:
    """The session of the ``compile_once`` active in this process, if any."""
    return _active


def current() -> Session | None:
    """The active session, or the last one to end, if any."""
    return _active or _last


def set_active(session: Session | None) -> None:
    """Called by ``compile_once`` as it enters (``session``) and exits (``None``)."""
    global _active, _last
    if session is None and _active is not None:
        _last = _active
    _active = session


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class Session:
    """Routes one process's Inductor cache traffic through a shared store."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stats = Stats(_current_rank())
        self.stats.store = _store_name(config.store)
        self.events = open_events(config.trace_dir, lambda: self.stats.rank, self.stats.count)
        self._flight: Singleflight | None = None
        self._open_lock = threading.Lock()
        self._told_no_store = False
        self._unusable = False
        self._prefix = ""
        self._node: NodeCache | None = None
        #: FX keys this rank asked the store for and then received or compiled; the others it
        #: found in its local cache.
        self._asked_fx: set[str] = set()
        self._local_fx: set[str] = set()
        self.kernels = ShippedKernels(_compat.inductor_cache_dir, _compat.triton_cache_dir, _cuda)
        self.ranks = RankDependence()
        self.tuning = TuningSteps(lambda: self._flight)
        self.early = EarlyBackwards(self.flight, self.events)
        self.stats.early_backward = self.early.counts
        self.shares = SplitShares(self.flight, self.store_key, self.events)
        if config.concurrent_splits:
            self.stats.split_shares = self.shares.counts

    # -- store -------------------------------------------------------------------------

    def flight(self) -> Singleflight | None:
        """The singleflight client, opened on first use; ``None`` while no store exists."""
        if self._flight is not None or self._unusable:
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
            # A store that cannot be opened will not open later: stop trying.
            log.warning("compile_once: cannot open the store (%s); compiling locally", exc)
            self.events.instant("store lost", error=str(exc))
            self._unusable = True
            return None
        rank = _current_rank()
        self.stats.rank, self.stats.store = rank, store.name
        self._node = NodeCache(_compat.inductor_cache_dir(), self.events)
        self._prefix = key_prefix(self.config.secret, self.config.namespace)
        warn_if_device_indices_differ(store, self._prefix, rank)
        return Singleflight(store, owner=Owner.this_process(rank), lease=self.config.lease,
                            wait_timeout=self.config.wait_timeout, progress_interval=self.config.progress_interval,
                            signalled_waits=self.config.signalled_waits, events=self.events)

    def store_key(self, kind: str, inductor_key: str) -> str:
        """The store key of Inductor's ``inductor_key`` of cache ``kind``."""
        digest = hashlib.sha256(inductor_key.encode()).hexdigest()[:40]
        return f"{self._prefix}/{kind}/{digest}"

    def first_local_hit(self, inductor_key: str) -> bool:
        """Whether Inductor serving FX graph ``inductor_key`` is this rank's first find of it
        in the local cache: the store was not asked for it (a remote hit, a rank-dependent
        graph), and no earlier lookup found it there (an early backward compile loads a
        graph that the backward pass then loads again)."""
        if inductor_key in self._asked_fx or inductor_key in self._local_fx:
            return False
        self._local_fx.add(inductor_key)
        return True

    def _lookup(self, flight: Singleflight, kind: str, key: str, rejected: bytes | None = None) -> LookupResult:
        """Look ``key`` up once per node (``NodeCache.lookup``), blocking as its kind allows.
        A rank that holds a claim, or runs an early compile, does not wait; a rank waiting
        for a graph first compiles the backward graphs it knows. With ``rejected`` (a value
        of ``key`` that failed verification) the store is asked again, that value counting
        as missing: one rank claims the key and compiles it, the others wait for it."""
        step_claims, early_claims = self.tuning.claims(), self.early.claims()
        waits = _compat.CACHE_KINDS[kind].waits
        blocking = waits == "always" or (waits == "tuning_step" and step_claims is not None)
        if kind == "fx_graph" and _compat.in_aot_entry_load():
            blocking = False  # a miss compiles nothing here: no claim (docs/design.md, rule 1)
        may_wait = not flight.holds_claims() and early_claims is None
        work_first = self.early.help_once if kind == "fx_graph" and self.config.early_backward else None
        if rejected is not None:
            self._node.forget(key, rejected)
            result = flight.lookup(key, blocking=blocking, rejected=rejected)
            if result.value is not None:
                self._node.write(key, result.value)
        else:
            result = self._node.lookup(flight, key, blocking=blocking, work_first=work_first,
                                       wait_s=self.config.wait_timeout.total_seconds() if may_wait else None)
        if result.outcome != "node" and result.value is not None:
            self.stats.record_store_fetch()
        if result.outcome == "claimed":
            self.events.instant("claim", key=short_key(key))
            for claims in (step_claims, early_claims):
                if claims is not None:
                    claims.append(key)
        return result

    def _follow_share(self, flight: Singleflight, kind: str, key: str, result: LookupResult) -> LookupResult:
        """A split frame's chain found no AOTAutograd entry: wait while another rank
        compiles that submodule for the job (``coordinator.features.split_shares``), then look again."""
        position = _compat.chain_position()
        if position is None or not self.config.concurrent_splits:
            return result
        again = self.shares.follow(flight, position)
        if again is None:
            return result
        if again:
            result = self._lookup(flight, kind, key)
        if result.value is None:
            self.shares.missed()
        return result

    def backward_deferred(self, backward: _compat.DeferredBackward) -> None:
        """A backward AOTAutograd deferred: a share's own, or one to compile early."""
        if not _compat.capture_backward(backward) and self.config.early_backward:
            self.early.add(backward)

    def _missed(self, kind: str, key: str, inductor_key: str) -> None:
        self.stats.record_miss(kind)
        if kind == "fx_graph" and _compat.in_aot_entry_load():
            return  # AOTAutograd compiles the graph afresh, and looks it up again then
        # When this rank compiles a graph it did not claim (the store failed, or it held
        # another claim), kernels written since the miss travel with the entry.
        if _compat.ships_kernels(kind):
            self.kernels.missed(key)
        if kind == "fx_graph":
            self.ranks.compiling(key, inductor_key)
        self.events.compile_began(key)

    # -- the two calls Inductor makes ----------------------------------------------------

    def get(self, kind: str, inductor_key: str) -> bytes | None:
        """Return the payload for ``inductor_key`` or ``None`` (Inductor then compiles)."""
        flight = self.flight()
        key = self.store_key(kind, inductor_key)
        if flight is None:  # no store: Inductor compiles, and this rank's counts say so
            self.stats.record_miss(kind)
            if not (kind == "fx_graph" and _compat.in_aot_entry_load()):
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
                result = dataclasses.replace(result, value=None, outcome="rejected")
        if kind == "fx_graph":
            # Not before: an early compile stopped by its lookup (SkipCompile) has not asked
            # for the graph, and the rank may later find it in the local cache (a local rank
            # compiled it), which must then count as a local hit.
            self._asked_fx.add(inductor_key)
        if sealed is None:
            log.debug("compile_once: %s miss %s (%s)", kind, key, result.outcome)
            self._missed(kind, key, inductor_key)
            return None
        if sealed.meta.get("rank_dependent"):
            self.ranks.received_mark(key, sealed.meta)
            self._missed(kind, key, inductor_key)
            return None
        self._received(kind, key, sealed, len(result.value), from_node=result.outcome == "node", began=began)
        return sealed.payload

    def _lookup_once(self, flight: Singleflight, kind: str, key: str, rejected: bytes | None = None) -> LookupResult:
        result = self._lookup(flight, kind, key, rejected)
        if kind == "fx_graph" and self.early.claims() is not None and result.outcome != "claimed":
            # An early compile goes on only for a graph it claimed; one that a rank has,
            # or is compiling, is loaded when the backward pass needs it.
            raise _compat.SkipCompile(f"FX graph {key}: {result.outcome}")
        if kind == "fx_graph" and result.value is None and result.outcome != "claimed" and self.shares.compiling():
            # A share waits on nothing: a graph another rank is compiling leaves this
            # submodule to the chain.
            raise _compat.SkipCompile(f"FX graph {key}: {result.outcome}")
        if kind == "aot_autograd" and result.value is None and rejected is None:
            result = self._follow_share(flight, kind, key, result)
        return result

    def _verified(self, kind: str, key: str, value: bytes):
        """``value`` opened and verified, or ``None`` (logged) if it fails any check."""
        try:
            return open_sealed(key, value, secret=self.config.secret)
        except IntegrityError as exc:
            log.warning("compile_once: rejected %s entry %s from the store: %s", kind, key, exc)
            self.events.instant("rejected", key=short_key(key), why=str(exc))
            return None

    def _received(self, kind: str, key: str, sealed, nbytes: int, *, from_node: bool, began: float) -> None:
        """Write a hit's kernels, extend NCCL timeouts by the compile time it saves, count it."""
        written = 0
        try:
            written = self.kernels.emit(sealed.files) if sealed.files else 0
        except OSError as exc:
            log.warning("compile_once: could not write received kernels (%s); Inductor will compile them", exc)
        saved_s = sealed.meta.get("time_taken_ms", 0) / 1000.0
        self.kernels.record(kind, sealed.files, saved_s)
        if _compat.CACHE_KINDS[kind].inductor_extends_timeout:
            # Inductor extends by the entry's recorded compile time itself on this hit.
            extension = float(int(saved_s)) if _compat.has_nccl_process_group() else 0.0
        else:
            extension = _compat.extend_nccl_timeouts(saved_s)
        self.events.span("receive", began, key=short_key(key), bytes=nbytes, saved_s=round(saved_s, 3),
                         kernels=written, **{"from": "node" if from_node else "store"})
        if extension:
            self.events.instant("timeout extension", seconds=extension)

    def put(self, kind: str, inductor_key: str, data: bytes) -> None:
        """Publish Inductor's freshly computed entry to the other ranks."""
        flight = self.flight()  # first: opening the store names the keys' prefix
        key = self.store_key(kind, inductor_key)
        self.events.compile_ended(key)
        if flight is None:
            return
        if kind == "autotune" and _compat.defer_autotune_save(
            lambda files: self.publish(flight, kind, key, data, files)
        ):
            # Saved before coordinate descent refines it (or by the descent, whose
            # chosen kernel is known when it returns): the claim stays until then.
            return
        reads = self.ranks.compiled(key) if kind == "fx_graph" else None
        if reads is not None:
            self.kernels.forget(key)
            self.stats.record_rank_dependent()
            if self.ranks.mark(key, reads):  # ranks waiting on it, and every later lookup, compile their own
                self.publish(flight, kind, key, b"", {}, extra_meta={"rank_dependent": True, "reads": reads})
            return
        files: dict[str, bytes] = {}
        if _compat.ships_kernels(kind) and self.config.ship_cpu_kernels:
            files = self.kernels.built_for(key, flight.claim_started(key))
        else:
            self.kernels.forget(key)
        self.publish(flight, kind, key, data, files)

    def publish(self, flight: Singleflight, kind: str, key: str, data: bytes, files: dict[str, bytes],
                extra_meta: dict | None = None, *, local_copy: bool = False) -> bool:
        """Seal ``data`` (and ``files``) under ``key``, keep it on this node, publish it.
        ``local_copy``: the value is this rank's local cache entry of a graph (``local_hits``).

        Returns:
            Whether it was published.
        """
        match = _TIME_TAKEN.search(data[-256:])
        meta = {"time_taken_ms": int(match.group(1)) if match else 0, "rank": flight.owner.rank,
                "host": flight.owner.host, **(extra_meta or {})}
        self.kernels.record(kind, files, meta["time_taken_ms"] / 1000.0)
        blob = seal(key, data, meta=meta, files=files, secret=self.config.secret)
        try:
            self._node.write(key, blob)  # local ranks read it from disk, not the store
        except OSError as exc:
            log.debug("could not keep %s on this node: %s", key, exc)
        published = flight.publish(key, blob)
        if local_copy:
            self.events.instant("publish", key=short_key(key), bytes=len(blob), ok=published, local_copy=True)
        else:
            self.events.instant("publish", key=short_key(key), bytes=len(blob), ok=published)
        return published

    def compile_ended(self) -> None:
        """An outermost compile finished: release the claims it did not publish, and end
        the spans of the FX graphs it compiled without an entry."""
        self.events.compiles_ended("fx_graph")
        if self._flight is not None:
            released = self._flight.abandon_all()
            if released:
                log.debug("compile_once: released %d unpublished claims", released)

    def close(self) -> None:
        if self._flight is not None:
            self._flight.close()
        self.events.compiles_ended()
        self.events.close()


def _store_name(store: Any) -> str:
    """The configured store's kind as the summary names it, before it is opened."""
    if isinstance(store, str):
        return store.split("://", 1)[0]
    return getattr(store, "name", None) or "c10d"
