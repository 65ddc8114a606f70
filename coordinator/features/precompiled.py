"""Precompiled functions: a compiled function shared whole, installed without tracing.

The FX-graph and AOTAutograd caches spare a rank Inductor's and AOTAutograd's work, but
each rank still runs Dynamo: it traces every frame's bytecode to find the graphs and
their guards (4.4 s of a 7.3 s restart for an HF Llama on one H100). Torch's caching
precompile records, per ``torch.compile``-d function, every frame Dynamo traced for it
with its guards and transformed bytecode, plus each graph's compiled forward and
backward: a *package* (``_compat.precompile``). With ``Config.precompile`` on:

* **Publish.** When a compile ends, each package recorded since and complete (every
  graph's backward compiled) is sealed (checksum, HMAC with a secret) with the C++
  kernels this rank built or received (a package holds the kernels' source, not the
  libraries: a fresh node would run the compiler for each) and published under its
  key: the function's name, first line and a hash of its source, in the environment's
  namespace. A package is republished when it grows (a graph break, a recompile at a
  new shape); of the ranks that record the same growth, the first to say so publishes.
  Never one of a process whose compiles read the rank (``coordinator.features.rank_dependence``).
* **Install.** At ``torch.compile(fn)`` Dynamo asks for ``fn``'s package; a rank (of
  this job or a later one on the same store) that finds it verifies it, writes its
  kernels, and torch installs it: the first call runs compiled code, with no tracing.
  Without one in the store, torch's own disk cache answers (where a restored bundle put
  packages). Lookups never wait: a package is a shortcut, and a rank without one
  traces as before, getting every graph from the other caches.
* **Never wrong, never a crash.** A value that fails verification, a package of
  another Python, torch, Triton, CUDA or GPU, an edited source, or one that fails to
  install is a miss with a warning: the function is traced. A call whose guards fail
  (another dtype or shape) is traced as Dynamo traces any new input.

No wait is added, so no cycle can form. DDPOptimizer frames are never packaged (torch
builds their converter without one); they keep being traced, and served by
AOTAutograd's cache (``_compat.cached_split_graphs``).
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Iterable
from typing import Any

from coordinator import _compat
from coordinator.errors import IntegrityError, StoreError
from coordinator.features.base import Context, Feature, supported
from coordinator.features.rank_dependence import RankDependence
from coordinator.observe.stats import Counts
from coordinator.observe.trace import short_key
from coordinator.protocol.integrity import open_sealed

log = logging.getLogger(__name__)

KIND = "precompile"


class PackageCounts(Counts, installed=0, published=0, failed=0):
    """Precompiled functions installed without tracing, published, and refused."""

    line = "{installed} functions installed without tracing, {published} published, {failed} not installed"


class PrecompiledFunctions(Feature, counts=PackageCounts):
    """One process's packages: those it installed, and those it publishes."""

    name = "precompiled_functions"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._lock = threading.Lock()
        #: Packages Dynamo recorded here, by key (one per ``torch.compile`` of the function).
        self._packages: dict[str, list[Any]] = {}
        #: Keys recorded since they were last published.
        self._recorded: set[str] = set()
        #: Guarded entries of each package in the store as far as this rank knows.
        self._known: dict[str, int] = {}
        self._told_rank_read = False

    def enabled(self, routed: frozenset[str]) -> bool:
        return supported(self.context.config.precompile, _compat.precompile_unsupported,
                         "precompiled functions are off")

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.precompiled_functions(self.load, self.recorded, self.on_install),)

    def compile_ended(self) -> None:
        self.publish_ready()

    def load(self, key: str) -> bytes | None:
        """The verified package of ``key`` from the store, its kernels written; or ``None``."""
        context = self.context
        flight = context.flight()
        if flight is None:
            return None
        store_key = context.store_key(KIND, key)
        result = flight.lookup(store_key, blocking=False)
        if result.value is None:
            return None
        try:
            sealed = open_sealed(store_key, result.value, secret=context.config.store_secret)
        except IntegrityError as exc:
            log.warning("compile_once: rejected precompiled function %s from the store: %s; tracing it", key, exc)
            context.events.instant("rejected", key=short_key(store_key), why=str(exc))
            return None
        try:
            written = context.kernels.emit(sealed.files) if sealed.files else 0
        except OSError as exc:
            log.warning("compile_once: could not write a package's kernels (%s); Inductor will compile them", exc)
            written = 0
        context.kernels.record(KIND, sealed.files, 0.0)
        context.events.instant("receive", key=short_key(store_key), bytes=len(result.value), kernels=written,
                               **{"from": "store"})
        with self._lock:
            self._known[key] = sealed.meta.get("entries", 0)
        return sealed.payload

    def recorded(self, key: str, package: Any) -> None:
        """Dynamo recorded (traced a frame of) the package of ``key``, after its compile
        ended: published now if complete (a backward compiled with its forward, as with
        dynamic shapes), else at the end of the compile that completes it."""
        with self._lock:
            same = self._packages.setdefault(key, [])
            if not any(p is package for p in same):
                same.append(package)
            self._recorded.add(key)
        self.publish_ready()

    def on_install(self, key: str, error: BaseException | None) -> None:
        """Torch installed the package of ``key`` (``error`` ``None``) or could not."""
        with self._lock:
            if error is None:
                self.counts.installed += 1
            else:
                self.counts.failed += 1
                self._known.pop(key, None)
        if error is not None:
            log.warning("compile_once: precompiled function %s not installed (%s); tracing it", key, error)
            self.context.events.instant("rejected", key=short_key(self.context.store_key(KIND, key)),
                                         why=f"not installed: {error}")

    def publish_ready(self) -> None:
        """Publish each recorded package that is complete and larger than the store's
        (at each compile's end, and as Dynamo records a package)."""
        try:
            self._publish_ready()
        except Exception:  # never let the coordinator fail a compile
            log.warning("compile_once: publishing a precompiled function failed", exc_info=True)

    def _publish_ready(self) -> None:
        context = self.context
        flight = context.flight()
        if flight is None or not self._recorded:
            return
        ranks = context.feature(RankDependence)
        if ranks is not None and (ranks.reads_in_compiles or ranks.marked):
            if not self._told_rank_read:
                log.info("compile_once: this process's compiles read the rank; its precompiled functions "
                         "are not shared")
                self._told_rank_read = True
            self._recorded.clear()
            return
        with self._lock:
            recorded = [(key, list(self._packages[key])) for key in self._recorded]
        for key, packages in recorded:
            complete = _compat.complete_package(packages)
            if complete is None:  # a backward not compiled yet: at a later compile's end
                log.debug("precompiled function %s: not complete yet", key)
                continue
            entry, entries = complete
            with self._lock:
                self._recorded.discard(key)
                if entries <= self._known.get(key, 0):
                    continue
                self._known[key] = entries
            store_key = context.store_key(KIND, key)
            try:
                first = flight.first_to_mark(store_key, entries)
            except StoreError as exc:  # the publish below finds the store failed and records it
                log.debug("could not mark package %s: %s", key, exc)
                first = True
            if first:
                context.publish(flight, KIND, store_key, pickle.dumps(entry), context.kernels.read_recorded(),
                                extra_meta={"entries": entries})
                self.counts.published += 1
