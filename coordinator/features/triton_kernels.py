"""Triton kernels outside Inductor, compiled and tuned once per job.

Training jobs run Triton kernels that Inductor did not generate: libraries' (flash-linear-
attention, Liger, Unsloth) and users' own, eagerly or inside ``torch.compile``. Each rank
compiles each of them at its first call and, for an autotuned one, benchmarks every config.
From the moment Triton is imported in a session's process (``coordinator.starts``), the
cache manager Triton builds per kernel key is this feature's (``_compat.routed_triton_cache``):
it keeps files where Triton's ``FileCacheManager`` does, and what it does not find there it
asks the session for, as Inductor's cache backends do (``Context.get``/``put``: the node's
copy, the prefetch, the persistent layer, every value sealed and verified, a value that
fails is a miss; the entries it compiled or received go into the job's bundle,
``ShippedKernels.record_triton``). Its first lookup, at Triton's first compile or tuning,
starts the session's core (a process that imports Triton and compiles nothing pays nothing):

* **a kernel's compile** (``get_group`` of its metadata): kind ``triton``, keyed by Triton's
  own hash (source, options, backend and GPU architecture, environment, Triton's version)
  and the kernel's name. A miss claims it and Triton compiles; its ``put_group`` publishes
  the files a loader reads (the binary and its metadata; not the IRs Triton keeps beside
  them), with the seconds the compile took (the others extend their NCCL timeouts by them).
  Ranks that need it meanwhile wait, then install the files into their own Triton cache
  whole or not at all (``_compat.install_group``: in a dir of their own, checked against the
  entry, before the group file names them), and Triton loads them there.
* **a host C module** Triton builds with the host's compiler (``get_file`` of
  ``<module><EXT_SUFFIX>``: a kernel signature's launcher, the driver's utilities): kind
  ``triton`` too, keyed by Triton's hash of its source and the platform; a rank on empty
  dirs loads it instead of running the host's C compiler.
* **an autotuner's result** (``get_file`` of ``<kernel>.autotune.json``): kind
  ``triton_autotune``, keyed by Triton's hash and the GPU's name (``_compat.device_kind``):
  a result is shared only between devices of one kind (an H100 and an H200 share an
  architecture, so a kernel's binary, but not its best config). One rank benchmarks; the
  others wait and take its timings. Triton keeps results only for autotuners built with
  ``cache_results``; while the session runs, every autotuner keeps them
  (``_compat.autotuner_hooks``), unless ``TRITON_CACHE_AUTOTUNING=0``.
* **configs compiled at once, and by the ranks that wait**: the rank that tunes compiles
  every config of the tuning before its benchmark, several at once in threads (Triton's
  ``AsyncCompileMode``; its compiler releases the GIL), as many as its part of the host's
  cores (``compile_pool_size``), where Triton compiles them one by one inside the
  benchmark. A rank that waits for another rank's result compiles that tuning's configs
  meanwhile, from the last one back (the tuner goes from the first), as many at once: each
  is a compile lookup like any other, a config another rank holds is skipped, and the work
  stops at one already published. The tuner loads what the waiters compiled (waiting for a
  config still being compiled), so the configs are compiled once among the ranks, in less
  wall time than one rank takes.

Why no wait forms a cycle: a kernel's compile looks nothing up while its owner holds it
(``CacheKind.leaf``), so a rank waits for one even while it holds claims, and such a wait
ends when that compile does. A rank waits for an autotune result only while it holds no
claim (the session's rule); its owner waits only for compiles. A waiting rank's own compiles
run with no waits at all (``Singleflight.no_waits``).

A claim is released where it was taken, as the compile, the host module's build or the
tuning that took it ends (``_compat.compile_scopes``, ``autotuner_hooks``): one whose
compile raises (Triton never saves it) is abandoned at once, so the ranks waiting for it
compute it themselves, whatever keeps the failed compile's objects alive; no other thread's
cleanup releases it (the end of an outermost ``torch.compile`` releases Inductor's claims
only).

Inductor's compile workers, other processes, keep Triton's own file manager: the kernels
Inductor generates travel inside its FX-graph entries. Those Inductor compiles in the rank
itself (with one compile thread, a coordinate descent's
winner) go through this feature too, and are counted with the others.

A cache manager the user installed (``TRITON_CACHE_MANAGER``, ``knobs.cache.manager_class``)
stays in place: the session says so once and shares no Triton kernel outside Inductor. Set
after the session began (after ``import torch``), ``TRITON_CACHE_MANAGER`` is honoured from
then on (the session's class builds the user's), and a class the script puts on the knob
stays there at the end.
``triton_kernels=False`` turns the feature off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack

from coordinator import _compat
from coordinator.features.base import Feature, Part, supported
from coordinator.features.compile_workers import local_ranks
from coordinator.observe.stats import Counts
from coordinator.protocol.outcome import Outcome

log = logging.getLogger(__name__)

KERNEL = "triton"
TUNING = "triton_autotune"


class TritonCounts(Counts, configs_compiled_ahead=0, configs_left=0, device=str):
    """Configs of another rank's tuning this rank compiled while it waited for the result
    (``configs_compiled_ahead``) and those it left to other ranks (held or done there:
    ``configs_left``); the device kind autotune results are shared within (``device``).
    Kernels compiled and received, tunings run and received are the session's counts of
    the ``triton`` and ``triton_autotune`` kinds (``Stats``)."""

    line = "triton: {configs_compiled_ahead} configs compiled for other ranks' tunings, {configs_left} left to them"
    shown_if = ("configs_compiled_ahead", "configs_left")


class _Ahead(Exception):
    """Ends a config's compile ahead of its tuning: another rank holds it, or it is done."""


#: A kernel entry's first byte when its files are compressed (a msgpack map never starts so).
_COMPRESSED = b"Z"


def _pack(files: dict[str, bytes]) -> bytes:
    """A kernel entry: its files by name, compressed (a binary and its metadata shrink 2-4×)."""
    return _COMPRESSED + zlib.compress(msgpack.packb(files, use_bin_type=True), 1)


def _unpack(payload: bytes) -> dict[str, bytes] | None:
    """A kernel entry's files by name, or ``None`` if it is not one (names are plain file names)."""
    try:
        if payload.startswith(_COMPRESSED):
            payload = zlib.decompress(payload[1:])
        files = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    if not isinstance(files, dict) or not files:
        return None
    for name, data in files.items():
        if not isinstance(name, str) or not isinstance(data, bytes) or "/" in name or name.startswith("."):
            return None
    return files


class TritonKernels(Feature, counts=TritonCounts):
    """Triton's own compiles and autotune results through the session."""

    name = "triton"
    part = Part.TRITON

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        #: Per thread: ``claims``, the (kind, store key) this thread claimed and has not saved
        #: yet; ``ahead``, the tuning whose configs it compiles ahead (``_AheadOf``) or None.
        self._thread = threading.local()
        self._lock = threading.Lock()

    def enabled(self, routed: frozenset[str]) -> bool:
        if importlib.util.find_spec("triton") is None:
            return False  # no Triton kernel to share
        return supported(self.context.config.triton_kernels, self._unsupported,
                         "Triton kernels outside Inductor are not shared")

    @staticmethod
    def _unsupported() -> str | None:
        lacking = _compat.triton_cache_unsupported()
        if lacking is not None:
            return lacking
        users = _compat.users_cache_manager()
        if users is not None:
            log.warning("compile_once: Triton's cache manager is the user's own (%s): Triton kernels outside "
                        "Inductor are not shared; unset TRITON_CACHE_MANAGER to share them", users)
            return f"the user's cache manager {users} stays in place"
        return None

    def hooks(self, routed: frozenset[str]) -> Iterable[contextlib.AbstractContextManager[Any]]:
        return [_compat.routed_triton_cache(_manager_class(self)),
                _compat.autotuner_hooks(cache_results=True, ended=self.tuning_ended),
                _compat.compile_scopes(ended=self.compile_ended_here, build_failed=self.compile_ended_here)]

    def _device(self) -> str:
        """The kind of device this thread tunes on, named in the summary and the report at
        the first tuning (not before: naming it initializes CUDA)."""
        kind = _compat.device_kind()
        if kind != self.counts.device:
            self.counts.device = kind
            self.context.events.instant("triton device", device=kind)
        return kind

    # -- what the manager asks ------------------------------------------------------------

    def fetch_kernel(self, manager: Any, filename: str) -> dict[str, str] | None:
        """A kernel Triton did not find on disk: from the session (installed whole into
        ``manager``'s directory, its group returned) or ``None``: Triton compiles it (under
        this rank's claim, if it took one)."""
        files = self._fetch_files(manager, filename)
        group = None if files is None else _compat.install_group(manager, filename, files)
        if group is not None:
            self.context.kernels.record_triton(manager.cache_dir)
        elif files is not None:  # another writer's files are there: Triton compiles it here
            self._began_now(manager, KERNEL, f"{manager.key}/{filename}")
        return group

    def fetch_module(self, manager: Any, filename: str) -> str | None:
        """A host C module (a kernel launcher, the driver's utilities) Triton did not find on
        disk: from the session (its path) or ``None``: Triton builds it."""
        files = self._fetch_files(manager, filename)
        if files is None:
            return None
        self.context.kernels.record_triton(manager.cache_dir)
        return _compat.installed_module(manager, filename, files[filename])

    def _fetch_files(self, manager: Any, filename: str) -> dict[str, bytes] | None:
        """The files of ``manager``'s entry ``filename`` from the session, or ``None``: this
        rank computes it (``_began_now``)."""
        key = f"{manager.key}/{filename}"
        payload = self._get(KERNEL, key)
        files = _unpack(payload) if payload is not None else None
        if files is None or filename not in files:
            if payload is not None:
                log.warning("compile_once: the Triton entry %s does not hold %s; building it here", key, filename)
            self._began_now(manager, KERNEL, key)
            return None
        return files

    def compiled(self, manager: Any, filename: str, group: dict[str, str]) -> None:
        """Triton saved a kernel it compiled (``group``: its files' paths by name): publish them."""
        files: dict[str, bytes] = {}
        try:
            for name, path in _compat.loader_files(group).items():
                with open(path, "rb") as f:
                    files[name] = f.read()
        except OSError as exc:  # the kernel is built here; the ranks waiting for it build it too
            log.warning("compile_once: could not read Triton's kernel %s to publish it: %s", filename, exc)
            self._release_thread_claims({KERNEL})
            return
        self._built(manager, filename, files)

    def _built(self, manager: Any, filename: str, files: dict[str, bytes]) -> None:
        if getattr(self._thread, "ahead", None) is not None:
            with self._lock:
                self.counts.configs_compiled_ahead += 1
        self.context.kernels.record_triton(manager.cache_dir)
        self._publish(manager, KERNEL, f"{manager.key}/{filename}", _pack(files))

    def module_built(self, manager: Any, filename: str, data: bytes) -> None:
        """Triton saved a host C module it built: publish it."""
        self._built(manager, filename, {filename: data})

    def fetch_tuning(self, manager: Any, filename: str) -> str | None:
        """An autotune result Triton did not find on disk: from the session (written into
        ``manager``'s directory, its path returned) or ``None``: Triton benchmarks."""
        key = f"{self._device()}/{manager.key}/{filename}"
        payload = self._get(TUNING, key)
        if payload is None:
            self._began_now(manager, TUNING, key)
            tuning = _compat.tuning_now()
            if tuning is not None:  # its configs compile at once, then the benchmark finds them built
                _compat.compile_configs(tuning, tuning.configs, self._threads(), each_task=self._task)
            return None
        self.context.kernels.record_triton(manager.cache_dir)
        return _compat.file_cache_manager().put(manager, payload, filename)

    def tuned(self, manager: Any, filename: str, data: Any) -> None:
        """Triton saved the timings of a tuning it ran: publish them."""
        key = f"{self._device()}/{manager.key}/{filename}"
        self.context.kernels.record_triton(manager.cache_dir)
        self._publish(manager, TUNING, key, data if isinstance(data, bytes) else str(data).encode())

    def _get(self, kind: str, key: str) -> bytes | None:
        try:
            return self.context.get(kind, key)
        except _Ahead:
            raise
        except Exception:  # never fail a kernel's compile
            log.warning("compile_once: looking Triton's %s entry %s up failed; computing it here", kind, key,
                        exc_info=True)
            return None

    def _began_now(self, manager: Any, kind: str, key: str) -> None:
        """This rank computes ``key`` now (Triton compiles or tunes it next, on this thread).

        A claim it took is released where it was taken, unsaved if Triton raised: as the
        kernel's compile ends (``compile_ended_here``), as a host module's build raises,
        as the tuning ends (``tuning_ended``), as a config's compile in a thread of
        ``compile_configs`` ends (``_task``); and a kernel's compile never runs inside
        another's on one thread, so one beginning releases what a compile before it left."""
        manager._coordinator_began = time.monotonic()
        store_key = self.context.store_key(kind, key)
        flight = self.context.flight()
        if kind == KERNEL:
            self._release_thread_claims({KERNEL})
        if flight is not None and flight.claim_started(store_key) is not None:
            self._thread_claims().append((kind, store_key))

    def _thread_claims(self) -> list[tuple[str, str]]:
        claims = getattr(self._thread, "claims", None)
        if claims is None:
            claims = self._thread.claims = []
        return claims

    def _release_thread_claims(self, kinds: set[str]) -> None:
        """Abandon the claims of ``kinds`` this thread took and did not save."""
        claims = self._thread_claims()
        for kind, store_key in [claim for claim in claims if claim[0] in kinds]:
            claims.remove((kind, store_key))
            self._abandon(store_key)

    def tuning_ended(self, failed: bool) -> None:
        """A tuning's lookup and benchmark ended on this thread (``failed``: it raised):
        what it claimed and did not publish is released."""
        self._release_thread_claims({KERNEL, TUNING} if failed else {TUNING})

    def compile_ended_here(self) -> None:
        """A Triton compile on this thread ended, or a host module's build raised: the
        kernel claims it took and did not publish are released."""
        self._release_thread_claims({KERNEL})

    def _abandon(self, store_key: str) -> None:
        flight = self.context.flight()
        if flight is not None and flight.claim_started(store_key) is not None:
            log.debug("compile_once: %s was claimed and never saved; its waiters compute it", store_key)
            flight.abandon(store_key)

    def _publish(self, manager: Any, kind: str, key: str, data: bytes) -> None:
        store_key = self.context.store_key(kind, key)
        claims = self._thread_claims()
        if (kind, store_key) in claims:
            claims.remove((kind, store_key))
        began = getattr(manager, "_coordinator_began", None)
        meta = {"time_taken_ms": int((time.monotonic() - began) * 1000)} if began is not None else None
        try:
            self.context.put(kind, key, data, meta)
        except Exception:  # never fail a kernel's compile; its waiters compute it
            log.warning("compile_once: publishing Triton's %s entry %s failed", kind, key, exc_info=True)
            self._abandon(store_key)

    # -- configs compiled while waiting for a tuning ------------------------------------------

    def work_while_waiting(self, kind: str) -> Callable[[], bool] | None:
        if kind != TUNING:
            return None
        tuning = _compat.tuning_now()
        if tuning is None or len(tuning.configs) < 2:
            return None
        left = list(reversed(tuning.configs))
        ahead = _AheadOf(tuning)
        threads = self._threads()

        def compile_batch() -> bool:
            """Compile the next configs from the end, as many at once as this rank has
            threads; False once none is left or one was found done."""
            if not left or ahead.done:
                return False
            batch, left[:] = left[:threads], left[threads:]
            _compat.compile_configs(tuning, batch, threads, each_task=lambda: self._task(ahead))
            return True

        return compile_batch

    def _threads(self) -> int:
        """Threads this rank compiles a tuning's configs in: its part of the host's cores."""
        return _compat.compile_pool_size(_compat.host_cpus(), local_ranks())

    @contextlib.contextmanager
    def _task(self, ahead: _AheadOf | None = None) -> Iterator[None]:
        """One config's compile in a thread of ``compile_configs``: ahead of another rank's
        tuning (``ahead``), with no waits at all; a compile that raises releases its claims."""
        flight = self.context.flight()
        self._thread.ahead = ahead
        try:
            with flight.no_waits() if flight is not None and ahead is not None else contextlib.nullcontext():
                yield
        finally:
            self._release_thread_claims({KERNEL})
            self._thread.ahead = None

    def forbids_waits(self) -> bool:
        return getattr(self._thread, "ahead", None) is not None

    def looked_up(self, flight: Any, kind: str, key: str, result: Any, rejected: bytes | None) -> Any:
        ahead = getattr(self._thread, "ahead", None)
        if kind == KERNEL and ahead is not None and result.outcome != Outcome.CLAIMED:
            # Ahead of a tuning, compile only what this rank claimed: a config held elsewhere
            # is left to its holder; one already done (or a store that does not answer) ends the work.
            with self._lock:
                self.counts.configs_left += 1
            if result.outcome != Outcome.NONBLOCKING:
                ahead.done = True
            raise _Ahead(f"{ahead.tuning.name}: {result.outcome}")
        return result


class _AheadOf:
    """Configs of one tuning compiled ahead by a rank waiting for its result."""

    def __init__(self, tuning: Any) -> None:
        self.tuning = tuning
        #: A config was found done: the tuner has come this far, the rest is its.
        self.done = False


def _manager_class(feature: TritonKernels) -> type:
    """A Triton cache manager class whose instances ask ``feature`` for what is not on disk."""
    base = _compat.file_cache_manager()
    told: set[type] = set()  # the user's managers the session named

    class CoordinatorCacheManager(base):  # type: ignore[misc, valid-type]
        """Triton's file cache with the session behind it (``coordinator.features.triton_kernels``)."""

        def __new__(cls, key: str, override: bool = False, dump: bool = False) -> Any:
            users = _compat.users_manager_class()
            if users is not None:  # the user's, set after the session began: theirs, not shared
                if users not in told:
                    told.add(users)
                    log.warning("compile_once: Triton's cache manager is the user's own (%s:%s), set after the "
                                "session began: Triton kernels outside Inductor are not shared from here on",
                                users.__module__, users.__qualname__)
                return users(key, override=True) if override else users(key, dump=True) if dump else users(key)
            return super().__new__(cls)

        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            super().__init__(key, override=override, dump=dump)
            self._shared = not (override or dump)

        def get_group(self, filename: str) -> dict[str, str] | None:
            group = super().get_group(filename)
            if group is None and self._shared and filename.endswith(".json"):
                group = feature.fetch_kernel(self, filename)
            return group

        def put_group(self, filename: str, group: dict[str, str]) -> str:
            path = super().put_group(filename, group)
            if self._shared:
                feature.compiled(self, filename, group)
            return path

        def get_file(self, filename: str) -> str | None:
            path = super().get_file(filename)
            if path is None and self._shared:
                if filename.endswith(_compat.AUTOTUNE_SUFFIX):
                    path = feature.fetch_tuning(self, filename)
                elif filename.endswith(_compat.HOST_MODULE_SUFFIX):
                    path = feature.fetch_module(self, filename)
            return path

        def put(self, data: Any, filename: str, binary: bool = True) -> str:
            path = super().put(data, filename, binary=binary)
            if self._shared:
                if filename.endswith(_compat.AUTOTUNE_SUFFIX):
                    feature.tuned(self, filename, data)
                elif filename.endswith(_compat.HOST_MODULE_SUFFIX) and isinstance(data, bytes):
                    feature.module_built(self, filename, data)
            return path

    return CoordinatorCacheManager
