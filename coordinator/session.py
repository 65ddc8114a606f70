"""One rank's coordinator session: what Inductor's cache backends call into.

A :class:`Session` turns Inductor cache reads and writes into singleflight lookups
and publishes. It opens its store lazily, at the first cache access: the training
script usually enters ``compile_once`` before or right after
``init_process_group``, and the default store exists only after it. Values are
sealed (checksum, HMAC, key binding) on the way out and verified on the way in; a
value that fails is a miss. FX-graph entries carry the CPU kernels compiled for
them. Cache kinds whose completion can depend on the forward pass (AOTAutograd,
PGO) are looked up without blocking.

A rank whose own local cache already holds an FX graph never asks the store for it
(Inductor reads its local cache first). :meth:`Session.fx_graph_served` closes that
gap: it publishes the local copy when no rank has, or waits on the store while another
rank compiles it. Without it a warm rank (a restarted job, a reused node) leaves cold
ranks compiling and reaches the first collective alone, where the collective's timeout
can end the job.

A graph whose code depends on the rank is never shared. Inductor passes can bake the
rank into a graph after its cache key is computed (bucketed all-gathers slice each
rank's shard at a rank-dependent offset), so every rank looks the graph up under the
same key. While this rank compiles a graph it missed, reads of the rank by code other
than torch.distributed's are recorded (``_compat.rank_reads``); a graph compiled with
any is published as a *rank-dependent mark* instead of its entry, kept out of Inductor's
local cache, and every rank that looks it up compiles its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator

from coordinator import _compat
from coordinator.artifacts import TRITON_PREFIX, collect_kernels, emit_kernels, emit_triton_kernels, read_kernels
from coordinator.config import Config
from coordinator.early_backward import EarlyBackwards
from coordinator.errors import ConfigError, IntegrityError, StoreError, WaitTimeout
from coordinator.fingerprint import fingerprint
from coordinator.integrity import open_sealed, seal
from coordinator.node import DeviceLock, NodeCache
from coordinator.singleflight import LookupResult, Owner, Singleflight
from coordinator.stats import Stats
from coordinator.stores import Store, open_store
from coordinator.stores.base import TimedStore

log = logging.getLogger(__name__)

#: Kinds a rank may wait for wherever it looks them up: their owner finishes them inside
#: its compile, with no collective. AOTAutograd entries are published after the backward
#: compiles, which can run after forward-pass collectives (FSDP all-gathers); PGO after
#: the run; bundled autotune results at the end of a compile, from kernels tuned by then.
#: Autotune entries are waited for only inside a kernel's tuning step
#: (:meth:`Session.tuning_step`): elsewhere (a graph's load) they are only read.
BLOCKING_KINDS = frozenset({"fx_graph"})

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
        self._flight: Singleflight | None = None
        self._open_lock = threading.Lock()
        self._told_no_store = False
        self._unusable = False
        self._miss_times: dict[str, float] = {}
        self._prefix = ""
        #: Kernel files this rank compiled or received, and the compile time of the FX
        #: graphs it compiled or received: what a whole-job bundle needs to carry.
        self.kernel_files: set[str] = set()
        self.graph_compile_time_s = 0.0
        self._node: NodeCache | None = None
        #: FX keys this rank asked the store for; the others it found in its local cache.
        self._asked_fx: set[str] = set()
        #: Autotune keys claimed by the tuning step open on each thread (None: no step).
        self._step = threading.local()
        #: FX graphs this thread is compiling (store key -> rank reads seen since its miss).
        self._compiling = threading.local()
        #: C++ kernel libraries resolved on each thread since its last FX miss.
        self._kernels_resolved = threading.local()
        #: Store keys of graphs whose code depends on the rank: never published, never loaded.
        self._rank_dependent: set[str] = set()
        #: Backward graphs this rank compiles while it waits (``coordinator.early_backward``).
        self.early = EarlyBackwards(self.early_compile,
                                    lambda: DeviceLock(f"early-backward-{_compat.device_name()}"))
        self.stats.early_backward = self.early.counts
        #: Claims of the early compile running on each thread (None: none runs).
        self._early = threading.local()

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
        except ConfigError as exc:  # cannot change while this process runs: stop trying
            log.warning("compile_once: cannot open the store (%s); compiling locally", exc)
            self._unusable = True
            return None
        except StoreError as exc:
            if not self._told_no_store:
                log.info("compile_once: no store yet (%s); compiling locally until there is one", exc)
                self._told_no_store = True
            return None
        rank = _current_rank()
        self.stats.rank = rank
        self._node = NodeCache(_compat.inductor_cache_dir())
        self.stats.store = store.name
        self._prefix = f"{fingerprint()}/{self.config.namespace or '_'}"
        self._check_device_index(store, rank)
        flight = Singleflight(
            store,
            owner=Owner.this_process(rank),
            lease=self.config.lease,
            wait_timeout=self.config.wait_timeout,
            progress_interval=self.config.progress_interval,
            signalled_waits=self.config.signalled_waits,
        )
        return flight

    def _check_device_index(self, store: Store, rank: int) -> None:
        """Warn once when ranks compile for different CUDA device indices.

        Inductor's FX keys and code carry the device index, so cuda:0 and cuda:1 ranks
        cannot share graphs; they still share among ranks with the same index.
        """
        import torch

        if not torch.cuda.is_available():
            return
        index = torch.cuda.current_device()
        try:
            store.set(f"{self._prefix}/device/{rank}", str(index).encode())
            peer = 1 if rank == 0 else 0
            other = store.get(f"{self._prefix}/device/{peer}")
        except StoreError:
            return
        if index != 0 or (other is not None and int(other) != index):
            log.warning(
                "compile_once: this rank compiles for cuda:%d%s. Inductor keys carry the device "
                "index, so only ranks on the same index share compiles. Give every worker its GPU "
                "as cuda:0: launch with coordinator-run, or torchrun --virtual-local-rank.",
                index, "" if other is None else f" and rank {peer} for cuda:{int(other)}",
            )

    def _lookup(self, flight: Singleflight, kind: str, key: str) -> LookupResult:
        """Look ``key`` up once per node: from this node's copy, else (under the node
        lock, so sibling ranks wait here instead of asking the store) from the store."""
        step_claims = getattr(self._step, "claims", None)
        early_claims = getattr(self._early, "claims", None)
        blocking = kind in BLOCKING_KINDS or (kind == "autotune" and step_claims is not None)
        node = self._node
        local = node.read(key)
        if local is not None:
            return LookupResult(local, "node")
        started = time.monotonic()
        # Waiting on the node lock is waiting too: a rank that holds a claim, or runs an
        # early compile, only tries it.
        may_wait = not flight.holds_claims() and early_claims is None
        timeout = self.config.wait_timeout.total_seconds() if may_wait else 0.0
        # A rank waiting for a graph first compiles the backward graphs it knows.
        work_first = self.early.help_once if kind == "fx_graph" and self.config.early_backward else None
        try:
            with node.lock(key, timeout, work_first if may_wait else None):
                lock_wait = time.monotonic() - started
                local = node.read(key)
                if local is not None:
                    return LookupResult(local, "node", lock_wait)
                result = flight.lookup(key, blocking=blocking, before_waiting=work_first)
                result.waited_s += lock_wait
                if result.value is not None:
                    node.write(key, result.value)
                    self.stats.record_store_fetch()
        except WaitTimeout:
            result = flight.lookup(key, blocking=blocking)
        except OSError as exc:
            log.warning("compile_once: node-local lookup of %s failed (%s); asking the store", key, exc)
            result = flight.lookup(key, blocking=blocking)
        if result.outcome == "claimed":
            for claims in (step_claims, early_claims):
                if claims is not None:
                    claims.append(key)
        return result

    def _key(self, kind: str, inductor_key: str) -> str:
        digest = hashlib.sha256(inductor_key.encode()).hexdigest()[:40]
        return f"{self._prefix}/{kind}/{digest}"

    def _note_miss(self, kind: str, key: str, inductor_key: str) -> None:
        # When this rank compiles a graph it did not claim (the store failed, or it
        # held another claim), kernels written since the miss travel with the entry.
        if kind == "fx_graph":
            self._miss_times[key] = time.time()
            self._compiling_now()[key] = (inductor_key, [])
            self._kernels_resolved.paths = []

    def cpu_kernel_resolved(self, path: str) -> None:
        """Inductor resolved the C++ kernel library ``path`` on this thread
        (``_compat.cpu_kernels_resolved``)."""
        paths = getattr(self._kernels_resolved, "paths", None)
        if paths is not None:
            paths.append(path)

    def _compiling_now(self) -> dict[str, tuple[str, list[str]]]:
        graphs = getattr(self._compiling, "graphs", None)
        if graphs is None:
            graphs = self._compiling.graphs = {}
        return graphs

    def rank_read(self, where: str) -> None:
        """Code read this process's rank (``_compat.rank_reads``): if this thread is
        compiling FX graphs, their code may depend on it."""
        for _, reads in self._compiling_now().values():
            if where not in reads:
                reads.append(where)

    def keep_graph_locally(self, local_key: str) -> bool:
        """Whether Inductor may write the FX graph of ``local_key`` (its own key, which
        the backend's key contains) to its local cache: not one whose code read the rank,
        so that a later job neither loads it on another rank nor shares it from there."""
        return not any(reads and local_key in inductor_key for inductor_key, reads in self._compiling_now().values())

    # -- the two calls Inductor makes ----------------------------------------------------

    def get(self, kind: str, inductor_key: str) -> bytes | None:
        """Return the payload for ``inductor_key`` or ``None`` (Inductor then compiles)."""
        flight = self.flight()
        if flight is None:
            return None
        if kind == "fx_graph":
            self._asked_fx.add(inductor_key)
        key = self._key(kind, inductor_key)
        result = self._lookup(flight, kind, key)
        if kind == "fx_graph" and getattr(self._early, "claims", None) is not None and result.outcome != "claimed":
            # An early compile goes on only for a graph it claimed; one that a rank has,
            # or is compiling, is loaded when the backward pass needs it.
            raise _compat.SkipCompile(f"FX graph {key}: {result.outcome}")
        if result.waited_s:
            self.stats.record_wait(result.waited_s)
        if result.outcome == "unavailable":
            self.stats.store_failed = True
        if result.value is None:
            log.debug("compile_once: %s miss %s (%s)", kind, key, result.outcome)
            self._note_miss(kind, key, inductor_key)
            self.stats.record_miss(kind)
            return None
        try:
            sealed = open_sealed(key, result.value, secret=self.config.secret)
        except IntegrityError as exc:
            log.warning("compile_once: rejected %s entry %s from the store: %s; compiling locally", kind, key, exc)
            self._note_miss(kind, key, inductor_key)
            self.stats.record_miss(kind, rejected=True)
            return None
        if sealed.meta.get("rank_dependent"):
            if key not in self._rank_dependent:
                self._rank_dependent.add(key)
                log.info("compile_once: FX graph %s depends on the rank (rank %s read it in %s); compiling it "
                         "on this rank", key, sealed.meta.get("rank"), ", ".join(sealed.meta.get("reads", [])))
            self._note_miss(kind, key, inductor_key)
            self.stats.record_miss(kind)
            return None
        kernels = 0
        if sealed.files:
            try:
                kernels = self._emit_files(sealed.files)
            except OSError as exc:
                log.warning("compile_once: could not write received kernels (%s); Inductor will compile them", exc)
        saved_s = sealed.meta.get("time_taken_ms", 0) / 1000.0
        if kind == "fx_graph":
            self.kernel_files.update(sealed.files)
            self.graph_compile_time_s += saved_s
        if kind in _compat.INDUCTOR_EXTENDS_TIMEOUT:
            # Inductor extends by the entry's recorded compile time itself on this hit.
            extension = float(int(saved_s)) if _compat.has_nccl_process_group() else 0.0
        else:
            extension = _compat.extend_nccl_timeouts(saved_s)
        self.stats.record_hit(kind, len(result.value), saved_s, extension, kernels, from_node=result.outcome == "node")
        log.debug("compile_once: %s hit %s (%s, %d kernels): %s", kind, key, result.outcome, kernels,
                  sealed.payload[:100] if kind == "autotune" else "")
        return sealed.payload

    def put(self, kind: str, inductor_key: str, data: bytes) -> None:
        """Publish Inductor's freshly computed entry to the other ranks."""
        flight = self.flight()
        if flight is None:
            return
        key = self._key(kind, inductor_key)
        if kind == "autotune" and _compat.defer_autotune_save(
            lambda files: self._publish(flight, kind, key, data, files)
        ):
            # Saved before coordinate descent refines it (or by the descent, whose
            # chosen kernel is known when it returns): the claim stays until then.
            log.debug("compile_once: holding %s until coordinate descent ends: %s", key, data[:160])
            return
        if kind == "autotune":
            log.debug("compile_once: publishing %s now: %s", key, data[:160])
        if kind == "fx_graph":
            _, reads = self._compiling_now().pop(key, ("", []))
            if reads or key in self._rank_dependent:
                self._miss_times.pop(key, None)
                self._mark_rank_dependent(flight, key, reads)
                return
        files: dict[str, bytes] = {}
        missed_at = self._miss_times.pop(key, None)
        since = flight.claim_started(key) or missed_at
        if kind == "fx_graph" and self.config.ship_cpu_kernels and since is not None:
            # What the compile built, and the kernels it found built already (by an
            # earlier graph): a rank may load this graph before that one.
            files = collect_kernels(_compat.inductor_cache_dir(), since)
            resolved, self._kernels_resolved.paths = getattr(self._kernels_resolved, "paths", None) or [], None
            files = {**read_kernels(_compat.inductor_cache_dir(), resolved), **files}
        self._publish(flight, kind, key, data, files)

    def fx_graph_served(
        self, inductor_key: str, remote_value: Callable[[], bytes | None], kernel_paths: list[str]
    ) -> None:
        """Inductor served an FX graph; if from this rank's local cache, share it.

        Called through ``_compat.fx_graph_lookups``, to which ``route_caches`` passes it only
        when ``config.share_local_hits`` is on.

        The store has it: nothing to do. No rank has it: claim it and publish the local
        copy (with its CPU kernels), so that cold ranks load instead of compiling. Another
        rank is compiling it: wait on the store until it publishes (or gives up, or its
        lease or the deadline ends), so that this rank does not reach the first
        collective while that rank still compiles.
        """
        if inductor_key in self._asked_fx:  # a remote hit (or a rank-dependent graph): nothing to share
            return
        flight = self.flight()
        if flight is None:
            return
        key = self._key("fx_graph", inductor_key)
        result = flight.offer(key)
        if result.waited_s:
            self.stats.record_wait(result.waited_s)
        if result.outcome == "unavailable":
            self.stats.store_failed = True
        if result.outcome != "claimed":
            if result.waited_s >= 1.0:
                log.info("compile_once: FX graph %s is in this rank's local cache, but another rank was compiling "
                         "it; waited %.1fs on the store for it (%s), not in a collective",
                         key, result.waited_s, result.outcome)
            return
        try:
            value = remote_value()
            if value is None:  # several guarded entries locally: which one hit is unknown
                flight.abandon(key)
                return
            files = read_kernels(_compat.inductor_cache_dir(), kernel_paths) if self.config.ship_cpu_kernels else {}
            self._publish(flight, "fx_graph", key, value, files)
        except BaseException:
            flight.abandon(key)
            raise
        self.stats.record_shared_from_local()
        log.info("compile_once: shared FX graph %s from this rank's local cache (%d kernel files)", key, len(files))

    def _emit_files(self, files: dict[str, bytes]) -> int:
        """Write received kernel files into this rank's caches; returns how many."""
        triton = {rel: data for rel, data in files.items() if rel.startswith(TRITON_PREFIX)}
        cpu = {rel: data for rel, data in files.items() if rel not in triton}
        written = emit_kernels(_compat.inductor_cache_dir(), cpu)
        if triton:
            written += emit_triton_kernels(_compat.triton_cache_dir(), triton)
        return written

    @contextlib.contextmanager
    def tuning_step(self) -> Iterator[None]:
        """A Triton kernel tunes at its first launch on this thread (config search, then
        coordinate descent): a leaf step. Its autotune lookup claims the key when no rank
        has published it and none is tuning it, or waits for the rank that is; the claim
        ends with the step, published by the kernel's save or abandoned. Outside a step,
        autotune keys are only read, so no rank holds an autotune claim across a
        collective or while it waits for a graph."""
        self._step.claims = claims = []
        try:
            yield
        finally:
            self._step.claims = None
            if claims and self._flight is not None:
                for key in claims:
                    self._flight.abandon(key)  # a no-op for a key the step published

    @contextlib.contextmanager
    def early_compile(self) -> Iterator[list[str]]:
        """A backward graph compiled early, inside a wait on this thread
        (``coordinator.early_backward``): its lookups never wait, an FX lookup that does
        not claim stops it (``SkipCompile``), and the claims it leaves unpublished are
        released when it ends. Yields the list of keys it claims."""
        flight = self.flight()
        if flight is None:
            raise _compat.SkipCompile("no store")
        self._early.claims = claims = []
        try:
            with flight.no_waits():
                yield claims
        finally:
            self._early.claims = None
            for key in claims:
                flight.abandon(key)  # a no-op for a key it published

    def _mark_rank_dependent(self, flight: Singleflight, key: str, reads: list[str]) -> None:
        """Publish a mark in place of a graph whose code read the rank: ranks waiting on
        it, and every later lookup, compile their own."""
        self.stats.record_rank_dependent()
        if key in self._rank_dependent:
            return
        self._rank_dependent.add(key)
        log.info("compile_once: FX graph %s read the rank while compiling (in %s): its code may differ between "
                 "ranks, so it is not shared; every rank compiles its own", key, ", ".join(reads))
        self._publish(flight, "fx_graph", key, b"", {}, extra_meta={"rank_dependent": True, "reads": reads})

    def _publish(self, flight: Singleflight, kind: str, key: str, data: bytes, files: dict[str, bytes],
                 extra_meta: dict | None = None) -> None:
        match = _TIME_TAKEN.search(data[-256:])
        meta = {
            "time_taken_ms": int(match.group(1)) if match else 0,
            "rank": flight.owner.rank,
            "host": flight.owner.host,
            **(extra_meta or {}),
        }
        if kind == "fx_graph":
            self.kernel_files.update(files)
            self.graph_compile_time_s += meta["time_taken_ms"] / 1000.0
        blob = seal(key, data, meta=meta, files=files, secret=self.config.secret)
        try:
            self._node.write(key, blob)  # local ranks read it from disk, not the store
        except OSError as exc:
            log.debug("could not keep %s on this node: %s", key, exc)
        if flight.publish(key, blob):
            self.stats.record_publish(kind, len(blob))
        else:
            self.stats.store_failed = True

    def compile_ended(self) -> None:
        """An outermost compile finished: release the claims it did not publish."""
        if self._flight is not None:
            released = self._flight.abandon_all()
            if released:
                log.debug("compile_once: released %d unpublished claims", released)

    def close(self) -> None:
        if self._flight is not None:
            self._flight.close()
