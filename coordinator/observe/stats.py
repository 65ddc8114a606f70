"""Per-rank counters of what the coordinator did, and the one-line summary.

``compile_once`` logs :meth:`Stats.summary` on exit (the details at DEBUG) and
``coordinator.stats()`` returns :meth:`Stats.as_dict`.

The counters that ``coordinator report`` shows too are counted from the rank's events
(``coordinator.observe.trace``), by :meth:`Stats.count`, the one function both use: the session
counts each event as it emits it, the report counts the events the rank's trace file
holds. So the summary and the report agree, and say:

* compiled: FX graphs this rank compiled (a compile span: from its miss to Inductor's
  entry, or to the end of the compile when Inductor saved none);
* received: FX graphs loaded from the store or from this node's copy;
* local: FX graphs found in this rank's own Inductor cache dir (a warm rank, or a node
  whose local ranks share the dir), of which "shared" were published from there;
* waits, waited: waits on another process's work (a compile on the store, a local rank's
  fetch on the node's lock), and their seconds; not the work a rank does meanwhile;
* saved: the compile time this rank did not spend: the compile time recorded with each
  FX graph it loaded instead of compiling (from the store, this node's copy, or a bundle
  installed into its local cache), each graph once; never more than the sum of those
  entries' compile times. Graphs found in the local cache that no bundle put there, and
  AOTAutograd entries (whose recorded time holds their FX graphs' compiles and the waits
  for them: ``_compat.hit_saves_compile``), add nothing;
* MB in: bytes fetched from the store (values read again from this node's copy, a graph
  that repeats or one a local rank fetched, are counted apart as ``bytes_from_node``);
  MB out: bytes published;
* rejected: values that failed verification;
* Triton kernels outside Inductor (``coordinator.features.triton_kernels``), where the
  rank ran any: kernels it compiled and received, tunings it ran (benchmarked) and received
  (the ``triton`` and ``triton_autotune`` kinds' compiles and receives).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

log = logging.getLogger(__name__)


class Counts:
    """Counters declared in their class line: ``class Mine(Counts, hits=0, seconds=0.0,
    failed=False, frames=list)`` is a dataclass of those fields, in that order, after any its
    body annotates (a field without a default, such as a table row's key); each starts at the
    value given, or at a fresh call of the type given (``list``: a list of its own).

    Its :meth:`summary` (a line of ``Stats.details``) is :attr:`line` with the counts filled in
    (``str.format``); nothing while every count :attr:`shown_if` names is 0. A class whose line
    needs more than that overrides it."""

    #: The summary line, ``{name}`` standing for a count (empty: it says nothing).
    line: ClassVar[str] = ""
    #: Counts of which one at least must not be 0 for a summary line (empty: always one).
    shown_if: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **fields: Any) -> None:
        super().__init_subclass__()
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, start in fields.items():
            fresh = isinstance(start, type)
            annotations[name] = start if fresh else type(start)
            setattr(cls, name, dataclasses.field(default_factory=start) if fresh else start)
        cls.__annotations__ = annotations
        dataclasses.dataclass(cls)

    def summary(self) -> str:
        if self.shown_if and not any(getattr(self, name) for name in self.shown_if):
            return ""
        return self.line.format_map(vars(self))

    def add(self, **added: float) -> None:
        """Add to counts by name (under the lock of whoever shares them between threads)."""
        for name, n in added.items():
            setattr(self, name, getattr(self, name) + n)


class SplitGraphCounts(Counts, saved=0, served=0, bypassed=0, refused=0):
    """DDPOptimizer's split graphs in AOTAutograd's cache (``_compat.cached_split_graphs``):
    misses ``saved`` to AOTAutograd's cache with their fake outputs; hits whose fake outputs
    were rebuilt (``served``); misses left to the bypass, their outputs cannot be described
    (``bypassed``); hits turned into misses, no description or one that does not fit
    (``refused``)."""


class KindCounts(Counts, hits=0, misses=0, compiled=0, published=0, rejected=0):
    """One cache kind's lookups and publishes: ``misses`` counts lookups that found no
    usable value, ``compiled`` the values this rank computed (an FX graph looked up while
    AOTAutograd loads an entry is a miss, compiled at a later lookup)."""


#: The counts of Triton's kernels outside Inductor in ``Stats.as_dict``.
_TRITON_COUNTS = ("triton_kernels_compiled", "triton_kernels_received", "triton_tunings_run", "triton_tunings_received")


def _kind(key: str) -> str:
    return key.split("/", 1)[0]


class Stats:
    """Thread-safe counters for one rank."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self.kinds: dict[str, KindCounts] = defaultdict(KindCounts)
        self.local_hits = 0
        #: Split graphs this rank compiled for the job (``coordinator.features.split_shares``).
        self.shares_compiled = 0
        self.shared_from_local = 0
        self.waits = 0
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
        self.rank_dependent = 0
        self.store = "none"
        #: Each compile feature's counters by its name (``coordinator.features``): a
        #: dataclass while the feature is on, ``None`` while it is off.
        self.features: dict[str, Any] = {}
        self.split_graphs = SplitGraphCounts()
        #: The writer that publishes behind the compile (``coordinator.protocol.writer``), if any.
        self.writer: Any = None
        self.aot_autograd_hits: Callable[[], int] = lambda: 0

    def count(self, event: dict) -> None:
        """Count one coordinator event (a ``coordinator.observe.trace`` event: ``name``, ``args``,
        ``dur`` in microseconds for a span); events that count nothing are ignored."""
        name, args = event.get("name"), event.get("args", {})
        kind = _kind(args.get("key", ""))
        with self._lock:
            if name == "compile":
                self.kinds[kind].compiled += 1
            elif name == "receive":
                self.kinds[kind].hits += 1
                if args.get("from") == "node":
                    self.bytes_from_node += args.get("bytes", 0)
                else:
                    self.bytes_received += args.get("bytes", 0)
                self.compile_time_saved_s += args.get("saved_s", 0.0)
                self.kernels_received += args.get("kernels", 0)
            elif name == "local hit" and kind == "fx_graph":
                self.local_hits += 1
                self.compile_time_saved_s += args.get("saved_s", 0.0)
            elif name == "wait":
                self.waits += 1
                self.waited_s += event.get("dur", 0.0) / 1e6
            elif name == "publish" and args.get("ok"):
                self.kinds[kind].published += 1
                self.bytes_published += args.get("bytes", 0)
                self.shared_from_local += int(bool(args.get("local_copy")))
            elif name == "rejected":
                self.kinds[kind].rejected += 1
            elif name == "timeout extension":
                self.timeout_extension_s += args.get("seconds", 0.0)
            elif name == "store lost":
                self.store_failed = True
            elif name == "share" and args.get("outcome") == "compiled":
                self.shares_compiled += 1

    def record_miss(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind].misses += 1

    def record_rank_dependent(self) -> None:
        with self._lock:
            self.rank_dependent += 1

    def record_split_graph(self, event: str) -> None:
        with self._lock:
            self.split_graphs.add(**{event: 1})

    def record_store_fetch(self) -> None:
        with self._lock:
            self.store_fetches += 1

    def record_store_call(self, seconds: float) -> None:
        with self._lock:
            self.store_calls += 1
            self.store_s += seconds

    def as_dict(self) -> dict:
        with self._lock:
            fx = self.kinds.get("fx_graph", KindCounts())
            kernels, tunings = self.kinds.get("triton", KindCounts()), self.kinds.get("triton_autotune", KindCounts())
            return {
                "rank": self.rank,
                "store": self.store,
                "graphs_compiled": fx.compiled,
                "graphs_received": fx.hits,
                "graphs_found_in_local_cache": self.local_hits,
                "split_graphs_compiled_for_the_job": self.shares_compiled,
                "graphs_shared_from_local_cache": self.shared_from_local,
                "graphs_rank_dependent": self.rank_dependent,
                "triton_kernels_compiled": kernels.compiled,
                "triton_kernels_received": kernels.hits,
                "triton_tunings_run": tunings.compiled,
                "triton_tunings_received": tunings.hits,
                "waits": self.waits,
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
                "graphs_skipped_aot_autograd": self.aot_autograd_hits(),
                "ddp_split_graphs": dataclasses.asdict(self.split_graphs),
                "publish_queue": None if self.writer is None else {
                    name: getattr(self.writer, name) for name in ("written", "written_bytes", "refused", "failed")},
                **{name: dataclasses.asdict(counts) if counts is not None else None
                   for name, counts in self.features.items()},
            }

    def summary(self) -> str:
        """One line, under 200 characters for counts up to 5 digits; :meth:`details` and
        :meth:`as_dict` have the rest."""
        d = self.as_dict()
        store = d["store"] + (", failed" if d["store_failed"] else "")
        prefetch = d.get("prefetch") or {}
        ahead = f"; prepared ahead {prefetch['prepared']}, used {prefetch['used']}" if prefetch.get("indexed") else ""
        triton = ""
        if any(d[name] for name in _TRITON_COUNTS):
            triton = (f"; triton compiled {d['triton_kernels_compiled']}, received {d['triton_kernels_received']}, "
                      f"tuned {d['triton_tunings_run']}, received {d['triton_tunings_received']}")
        return (f"compile_once rank {d['rank']}: compiled {d['graphs_compiled']}, received {d['graphs_received']}, "
                f"local {d['graphs_found_in_local_cache']}, rank-dependent {d['graphs_rank_dependent']}; "
                f"waits {d['waits']} ({d['waited_s']:.1f}s); saved {d['compile_time_saved_s']:.1f}s; "
                f"MB in {d['bytes_received'] / 1e6:.2f}, out {d['bytes_published'] / 1e6:.2f}; "
                f"rejected {d['rejected']}; store {store}{ahead}{triton}")

    def details(self) -> str:
        """What the summary leaves out, for the DEBUG log (all of it is in :meth:`as_dict`)."""
        d = self.as_dict()
        return (f"compile_once rank {d['rank']} details: {d['graphs_shared_from_local_cache']} graphs shared from "
                f"the local cache; {d['bytes_from_node'] / 1e6:.2f} MB from this node's copy; "
                f"{d['kernels_received']} kernel files received; NCCL timeout extended by "
                f"{d['timeout_extension_s']:.0f}s; store {d['store_calls']} calls, {d['store_s']:.1f}s, "
                f"{d['store_fetches']} fetches"
                + self._aot_summary(d["graphs_skipped_aot_autograd"], d["ddp_split_graphs"])
                + self._writer_summary(d["publish_queue"])
                + "".join(f"; {line}" for line in self._feature_lines())
                + f"; by cache {d['by_cache']}")

    @staticmethod
    def _aot_summary(skipped: int, split: dict) -> str:
        if not skipped and not any(split.values()):
            return ""
        return (f"; {skipped} graphs skipped AOTAutograd ({split['served']} of them DDP split graphs; "
                f"{split['saved']} split graphs saved, {split['bypassed'] + split['refused']} left to AOTAutograd)")

    @staticmethod
    def _writer_summary(writer: dict | None) -> str:
        if not writer or not any(writer.values()):
            return ""
        return (f"; published behind the compile: {writer['written']} writes ({writer['written_bytes'] / 1e6:.1f} MB), "
                f"{writer['refused']} refused, {writer['failed']} failed")

    def _feature_lines(self) -> list[str]:
        """Each feature's line (its counts' ``summary()``), where it has something to say."""
        with self._lock:
            counts = [c for c in self.features.values() if c is not None and hasattr(c, "summary")]
        return [line for line in (c.summary() for c in counts) if line]
