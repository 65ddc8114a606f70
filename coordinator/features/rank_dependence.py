"""Graphs whose code depends on the rank are never shared.

Inductor passes can bake the rank into a graph after its cache key is computed
(bucketed all-gathers slice each rank's shard at a rank-dependent offset), so every
rank looks the graph up under the same key. While this rank compiles a graph it
missed, reads of the rank by code other than torch.distributed's are recorded
(``_compat.rank_reads``); a graph compiled with any is published as a *rank-dependent
mark* instead of its entry, kept out of Inductor's local cache, and every rank that
looks it up compiles its own. Always on: it is a rule of sharing, not a choice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.protocol.singleflight import Singleflight

log = logging.getLogger(__name__)


class RankDependence(Feature):
    """The FX graphs this process compiles, the rank reads seen while it does, and the
    store keys known to depend on the rank."""

    name = "rank_dependence"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        #: FX graphs this thread is compiling (store key -> (Inductor's key, rank reads since its miss)).
        self._compiling = threading.local()
        #: Store keys of graphs whose code depends on the rank: never published, never loaded.
        self.marked: set[str] = set()
        #: Reads of the rank inside any compile (Dynamo's tracing included): a precompiled
        #: function of this process may have the rank in its code (``coordinator.features.precompiled``).
        self.reads_in_compiles = 0

    def _graphs(self) -> dict[str, tuple[str, list[str]]]:
        graphs = getattr(self._compiling, "graphs", None)
        if graphs is None:
            graphs = self._compiling.graphs = {}
        return graphs

    def compiling(self, key: str, inductor_key: str) -> None:
        """This thread missed FX graph ``key`` and compiles it now."""
        self._graphs()[key] = (inductor_key, [])

    def rank_read(self, where: str) -> None:
        """Code read this process's rank: the graphs this thread compiles may depend on it."""
        if _compat.current_compile_id() is not None:
            self.reads_in_compiles += 1
        for _, reads in self._graphs().values():
            if where not in reads:
                reads.append(where)

    def keep_locally(self, local_key: str) -> bool:
        """Whether Inductor may write the FX graph of ``local_key`` (its own key, which the
        backend's key contains) to its local cache: not one whose code read the rank, so
        that a later job neither loads it on another rank nor shares it from there."""
        return not any(reads and local_key in inductor_key for inductor_key, reads in self._graphs().values())

    def compiled(self, key: str) -> list[str] | None:
        """This thread's compile of ``key`` ended: the rank reads that make it rank-dependent
        (``None``: it may be shared). A key marked already stays marked."""
        _, reads = self._graphs().pop(key, ("", []))
        if reads or key in self.marked:
            return reads
        return None

    def mark(self, key: str, reads: list[str]) -> bool:
        """Remember ``key`` as rank-dependent; returns whether it is new here."""
        if key in self.marked:
            return False
        self.marked.add(key)
        log.info("compile_once: FX graph %s read the rank while compiling (in %s): its code may differ between "
                 "ranks, so it is not shared; every rank compiles its own", key, ", ".join(reads))
        return True

    def received_mark(self, key: str, meta: dict) -> None:
        """Another rank published ``key``'s mark: this rank compiles its own."""
        if key not in self.marked:
            self.marked.add(key)
            log.info("compile_once: FX graph %s depends on the rank (rank %s read it in %s); compiling it "
                     "on this rank", key, meta.get("rank"), ", ".join(meta.get("reads", [])))

    # -- the feature's seam --------------------------------------------------------------

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.rank_reads(self.rank_read),)

    def missed(self, kind: str, key: str, inductor_key: str) -> None:
        if _compat.KINDS[kind].rank_checked:
            self.compiling(key, inductor_key)

    def accepts(self, kind: str, key: str, meta: dict) -> bool:
        if not meta.get("rank_dependent"):
            return True
        self.received_mark(key, meta)
        return False

    def keeps_locally(self, local_key: str) -> bool:
        return self.keep_locally(local_key)

    def publishes(self, flight: Singleflight, kind: str, key: str, data: bytes) -> bool:
        """A graph compiled while the rank was read is published as a mark, not an entry."""
        if not _compat.KINDS[kind].rank_checked:
            return False
        reads = self.compiled(key)
        if reads is None:
            return False
        context = self.context
        context.kernels.forget(key)
        context.stats.record_rank_dependent()
        if self.mark(key, reads):  # ranks waiting on it, and every later lookup, compile their own
            context.publish(flight, kind, key, b"", {}, extra_meta={"rank_dependent": True, "reads": reads})
        return True
