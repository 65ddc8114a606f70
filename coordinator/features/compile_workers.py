"""Inductor's compile workers in a session: started early in a cold job, not at all in a
restart whose entries all hit.

On a GPU, Inductor compiles Triton kernels in a pool of worker processes
(``_compat.compile_workers``). When the session's compile part starts (the script calls
``torch.compile``, before its first frame; ``coordinator.starts``), this feature gives the
rank its part of the host's cores for them, then:

* **a cold job** (no index of a previous run's entries, ``coordinator.features.prefetch``):
  starts the pool at once, with ``warm_compile_pool`` on, so that the first graph's
  kernels compile in the workers rather than one by one in the rank;
* **a restart** (the prefetch read an index that names entries, within
  ``INDEX_WAIT``): holds the pool back. Every kernel of an entry that hits loads in the
  rank, faster than through workers with nothing to compile, and no worker starts or has
  to be shut down at exit. The first graph this rank compiles itself (an FX-graph miss)
  starts the pool, as Inductor's own first compile would; a restart that never misses
  never starts it.

The hold only changes where kernels load, never what is compiled or looked up, and adds
no wait.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.features.prefetch import Prefetch
from coordinator.observe.stats import Counts

log = logging.getLogger(__name__)

#: Longest wait, as the compile part starts, for the prefetch to read the last run's index.
INDEX_WAIT_S = 1.0
#: The cache kind whose miss means this rank compiles kernels.
_COMPILES_KERNELS = "fx_graph"


class WorkerCounts(Counts, held=False, hits_held=0, started_at_miss=False):
    """Whether the pool was held back for a restart, the FX-graph hits served while it
    was, and whether a miss then started it."""

    def summary(self) -> str:
        if not self.held:
            return ""
        started = "started at the first miss" if self.started_at_miss else "never started"
        return f"compile workers held back through {self.hits_held} hits, {started}"


class CompileWorkers(Feature, counts=WorkerCounts):
    """This rank's compile workers: how many, and when they start."""

    name = "compile_workers"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._release: Callable[[bool], None] | None = None
        #: FX graphs asked for while the pool is held (a miss among them releases it).
        self._asked_while_held: set[str] = set()

    def started(self) -> None:
        _compat.size_compile_pool(local_ranks())
        prefetch = self.context.feature(Prefetch)
        if prefetch is not None and prefetch.expects_entries(INDEX_WAIT_S):
            self._release = _compat.hold_compile_pool()
            if self._release is not None:
                self.counts.held = True
                log.debug("compile_once: a restart: compile workers held back until this rank compiles a graph")
                return
        if self.context.config.warm_compile_pool:
            _compat.warm_compile_pool()  # the first share's kernels compile in the workers, not one by one

    def asked(self, kind: str, inductor_key: str) -> None:
        if self._release is not None and kind == _COMPILES_KERNELS:
            self._asked_while_held.add(inductor_key)
            self.counts.hits_held = len(self._asked_while_held)  # a miss takes its key back

    def missed(self, kind: str, key: str, inductor_key: str) -> None:
        if self._release is not None and kind == _COMPILES_KERNELS:
            self._asked_while_held.discard(inductor_key)
            self.counts.hits_held = len(self._asked_while_held)
            self.counts.started_at_miss = True
            self._stop_holding(start=True)

    def close(self) -> None:
        self._stop_holding(start=False)  # nothing started: no worker to shut down at exit

    def _stop_holding(self, *, start: bool) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(start)


def local_ranks() -> int:
    """The ranks on this host, as torchrun tells its workers (1 where it does not)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
