"""Per-rank counters of what the coordinator did, and the one-line summary.

``compile_once`` logs :meth:`Stats.summary` on exit and ``coordinator.stats()``
returns :meth:`Stats.as_dict`. "Compiled locally" counts FX-graph misses (each one
is a graph this rank compiled); "received" counts FX graphs loaded from another rank;
"shared" counts graphs this rank found in its own local cache and published. Bytes
"received" are those fetched from the store; values read again from this node's copy
(a graph that repeats, as a transformer's layers do, or one a local rank fetched) are
counted apart, as ``bytes_from_node``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class SplitGraphCounts:
    """DDPOptimizer's split graphs in AOTAutograd's cache (``_compat.cached_split_graphs``)."""

    #: Misses saved to AOTAutograd's cache with their fake outputs.
    saved: int = 0
    #: Hits whose fake outputs were rebuilt.
    served: int = 0
    #: Misses left to the bypass: their outputs cannot be described.
    bypassed: int = 0
    #: Hits turned into misses: no description, or one that does not fit.
    refused: int = 0


@dataclasses.dataclass
class KindCounts:
    """One cache kind's lookups and publishes: ``misses`` counts lookups that found no
    usable value, ``compiled`` the misses this rank computed the value for (an FX graph
    looked up while AOTAutograd loads an entry is a miss, compiled at a later lookup)."""

    hits: int = 0
    misses: int = 0
    compiled: int = 0
    published: int = 0
    rejected: int = 0


class Stats:
    """Thread-safe counters for one rank."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self.kinds: dict[str, KindCounts] = defaultdict(KindCounts)
        self.waited_s = 0.0
        self.bytes_received = 0
        self.bytes_from_node = 0
        self.bytes_published = 0
        self.kernels_received = 0
        self.compile_time_saved_s = 0.0
        self.timeout_extension_s = 0.0
        self.store_failed = False
        self.store_fetches = 0
        self.store_calls = 0
        self.store_s = 0.0
        self.shared_from_local = 0
        self.rank_dependent = 0
        self.store = "none"
        #: Early backward compiles' counters (``coordinator.early_backward``).
        self.early_backward: Any = None
        self.split_graphs = SplitGraphCounts()
        #: Precompiled functions' counters (``coordinator.precompiled``), when on.
        self.precompiled: Any = None
        #: Returns how many graphs skipped AOTAutograd (its cache hits) since the session began.
        self.aot_autograd_hits: Callable[[], int] = lambda: 0

    def record_hit(self, kind: str, nbytes: int, saved_s: float, extension_s: float, kernels: int,
                   *, from_node: bool = False) -> None:
        with self._lock:
            self.kinds[kind].hits += 1
            if from_node:
                self.bytes_from_node += nbytes
            else:
                self.bytes_received += nbytes
            self.compile_time_saved_s += saved_s
            self.timeout_extension_s += extension_s
            self.kernels_received += kernels

    def record_miss(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind].misses += 1

    def record_compile(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind].compiled += 1

    def record_rejected(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind].rejected += 1

    def record_publish(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.kinds[kind].published += 1
            self.bytes_published += nbytes

    def record_shared_from_local(self) -> None:
        with self._lock:
            self.shared_from_local += 1

    def record_rank_dependent(self) -> None:
        with self._lock:
            self.rank_dependent += 1

    def record_split_graph(self, event: str) -> None:
        with self._lock:
            setattr(self.split_graphs, event, getattr(self.split_graphs, event) + 1)

    def record_store_fetch(self) -> None:
        with self._lock:
            self.store_fetches += 1

    def record_store_call(self, seconds: float) -> None:
        with self._lock:
            self.store_calls += 1
            self.store_s += seconds

    def record_wait(self, seconds: float) -> None:
        with self._lock:
            self.waited_s += seconds

    def record_lookup(self, result: Any) -> None:
        """A singleflight lookup's wait, and whether the store failed in it."""
        if result.waited_s:
            self.record_wait(result.waited_s)
        if result.outcome == "unavailable":
            self.store_failed = True

    def as_dict(self) -> dict:
        with self._lock:
            fx = self.kinds.get("fx_graph", KindCounts())
            return {
                "rank": self.rank,
                "store": self.store,
                "graphs_compiled": fx.compiled,
                "graphs_received": fx.hits,
                "graphs_shared_from_local_cache": self.shared_from_local,
                "graphs_rank_dependent": self.rank_dependent,
                "waited_s": round(self.waited_s, 3),
                "bytes_received": self.bytes_received,
                "bytes_from_node": self.bytes_from_node,
                "bytes_published": self.bytes_published,
                "kernels_received": self.kernels_received,
                "compile_time_saved_s": round(self.compile_time_saved_s, 3),
                "timeout_extension_s": round(self.timeout_extension_s, 3),
                "rejected": sum(c.rejected for c in self.kinds.values()),
                "store_failed": self.store_failed,
                "store_fetches": self.store_fetches,
                "store_calls": self.store_calls,
                "store_s": round(self.store_s, 3),
                "by_cache": {kind: dataclasses.asdict(c) for kind, c in sorted(self.kinds.items())},
                "early_backward": (dataclasses.asdict(self.early_backward)
                                   if self.early_backward is not None else None),
                "graphs_skipped_aot_autograd": self.aot_autograd_hits(),
                "ddp_split_graphs": dataclasses.asdict(self.split_graphs),
                "precompiled_functions": (dataclasses.asdict(self.precompiled)
                                          if self.precompiled is not None else None),
            }

    def summary(self) -> str:
        d = self.as_dict()
        return (
            f"compile_once rank {d['rank']}: {d['graphs_compiled']} graphs compiled locally, "
            f"{d['graphs_received']} received, {d['graphs_shared_from_local_cache']} shared from its local cache, "
            f"{d['graphs_rank_dependent']} rank-dependent (not shared); waited {d['waited_s']:.1f}s; "
            f"received {d['bytes_received'] / 1e6:.2f} MB (and {d['bytes_from_node'] / 1e6:.2f} MB "
            f"from this node's copy); compile time saved {d['compile_time_saved_s']:.1f}s; "
            f"NCCL timeout extended by {d['timeout_extension_s']:.0f}s; rejected {d['rejected']}; "
            f"store {d['store']} ({d['store_calls']} calls, {d['store_s']:.1f}s)"
            + self._aot_summary(d["graphs_skipped_aot_autograd"], d["ddp_split_graphs"])
            + self._early_summary(d["early_backward"])
            + self._precompiled_summary(d["precompiled_functions"])
        )

    @staticmethod
    def _precompiled_summary(p: dict | None) -> str:
        if p is None:
            return ""
        return (f"; {p['installed']} functions installed without tracing, {p['published']} published, "
                f"{p['failed']} not installed")

    @staticmethod
    def _aot_summary(skipped: int, split: dict) -> str:
        if not skipped and not any(split.values()):
            return ""
        return (f"; {skipped} graphs skipped AOTAutograd ({split['served']} of them DDP split graphs; "
                f"{split['saved']} split graphs saved, {split['bypassed'] + split['refused']} left to AOTAutograd)")

    @staticmethod
    def _early_summary(e: dict | None) -> str:
        if not e or not (e["compiled"] or e["skipped"] or e["failed"]):
            return ""
        return (f"; backward graphs compiled early while waiting: {e['compiled']} ({e['seconds']:.1f}s), "
                f"{e['skipped']} left to other ranks, {e['failed']} failed")
