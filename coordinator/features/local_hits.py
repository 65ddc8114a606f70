"""FX graphs a rank finds in its own local cache: counted, and shared with the ranks that lack them.

A rank whose own local cache already holds an FX graph never asks the store for it
(Inductor reads its local cache first). Each such graph counts once as "local" in the
rank's summary; one that a bundle installed (``coordinator.protocol.node.bundled``) also
counts the compile time recorded with it as saved, as a graph loaded from the store does.

Without more, such a warm rank (a restarted job, a reused node) leaves cold ranks
compiling and reaches the first collective alone, where the collective's timeout can
end the job. So when Inductor serves a graph from the local cache
(``_compat.fx_graph_lookups`` reports it) and ``share_local_hits`` is on,
:meth:`LocalHits.served_locally` makes sure the store gets it:

* the store has it: nothing to do;
* no rank has it: claim it and publish the local copy (with its CPU kernels), so that
  cold ranks load instead of compiling;
* another rank is compiling it: wait on the store until it publishes (or gives up, or
  its lease or the deadline ends), so that this rank does not reach the first
  collective while that rank still compiles.

The wait is a singleflight wait like any other (``Singleflight.offer``): on a key whose
owner finishes it inside a compile, with no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.observe.trace import short_key
from coordinator.protocol.node import bundled
from coordinator.protocol.outcome import Outcome

log = logging.getLogger(__name__)

#: The kind a rank finds in its local cache.
KIND = "fx_graph"


class LocalHits(Feature):
    """The FX graphs this rank asked the store for, and those it found in its local cache."""

    name = "local_hits"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        #: FX keys this rank asked the store for and then received or compiled.
        self._asked: set[str] = set()
        #: FX keys found in the local cache and offered to the store.
        self._local: set[str] = set()

    def enabled(self, routed: frozenset[str]) -> bool:
        return KIND in routed  # counted always; shared with share_local_hits

    def asked(self, kind: str, inductor_key: str) -> None:
        # Not before the lookup ends: an early compile stopped by its lookup (SkipCompile)
        # has not asked for the graph, and the rank may later find it in the local cache
        # (a local rank compiled it), which must then count as a local hit.
        if kind == KIND:
            self._asked.add(inductor_key)

    def first_local_hit(self, inductor_key: str) -> bool:
        """Whether Inductor serving FX graph ``inductor_key`` is this rank's first find of it
        in the local cache: the store was not asked for it (a remote hit, a rank-dependent
        graph), and no earlier lookup found it there (an early backward compile loads a
        graph that the backward pass then loads again)."""
        if inductor_key in self._asked or inductor_key in self._local:
            return False
        self._local.add(inductor_key)
        return True

    def served_locally(self, inductor_key: str, remote_value: Callable[[], bytes | None],
                       kernel_paths: list[str], local_key: str = "", compile_s: float = 0.0) -> None:
        """Inductor served FX graph ``inductor_key``; if from this rank's local cache, count
        it and share it.

        ``remote_value`` builds the entry as Inductor would publish it (``None``: several
        guarded entries are local and which one hit is unknown); ``kernel_paths`` are the C++
        kernels the graph loaded; ``local_key`` is Inductor's own key of the graph, and
        ``compile_s`` the compile time recorded with its entry.
        """
        if not self.first_local_hit(inductor_key):  # a remote hit, or counted already: nothing to do
            return
        context = self.context
        flight = context.flight()
        key = context.store_key(KIND, inductor_key)
        if local_key and bundled(_compat.inductor_cache_dir(), local_key):
            context.events.instant("local hit", key=short_key(key), saved_s=round(compile_s, 3),
                                   **{"from": "bundle"})
        else:
            context.events.instant("local hit", key=short_key(key))
        if flight is None or not context.config.share_local_hits:
            return
        result = flight.offer(key)
        if result.outcome != Outcome.CLAIMED:
            if result.waited_s >= 1.0:
                log.info("compile_once: FX graph %s is in this rank's local cache, but another rank was compiling "
                         "it; waited %.1fs on the store for it (%s), not in a collective",
                         key, result.waited_s, result.outcome)
            return
        try:
            value = remote_value()
            if value is None:
                flight.abandon(key)
                return
            files = context.kernels.read(kernel_paths) if context.config.ship_cpu_kernels else {}
            context.publish(flight, KIND, key, value, files, local_copy=True)
        except BaseException:
            flight.abandon(key)
            raise
        log.debug("compile_once: shared FX graph %s from this rank's local cache (%d kernel files)", key, len(files))
