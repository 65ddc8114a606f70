"""Inductor's one-time set-up, done once a rank while the script still builds its job.

A rank's first compile pays for Inductor's one-time set-up (``_compat.inductor_setup``:
its modules, torch's build hash, on a GPU Triton's code generation). In a DDP job that
first compile is the rank's first share of a split frame
(``coordinator.features.split_shares``), so the set-up lands inside the share, on the
job's critical path. When the session's compile part starts (the script's
``torch.compile`` call, before it builds DDP and its optimizer), this feature runs the
set-up in a thread of its own, while the script goes on.

No step runs beside a compile's tracing (a module imported while Dynamo reads the tables
it fills): when a compile starts on any thread (Dynamo's start callback, before a frame
is traced or a lazy backward compiled), the set-up stops after the step under way, and
the compile waits for that step; the compile takes what was left itself, as without the
set-up. So a step runs once, on one thread, and a compile waits at most one step that
its own start would have run first (the steps run in the order a compile needs them).
The wait ends when the step does (none waits on another rank or compiles) or after
``WAIT_S``.

A restart whose entries hit compiles nothing itself: where the prefetch read an index that
names entries (``Prefetch.expects_entries``), there is no set-up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.features.compile_workers import INDEX_WAIT_S
from coordinator.features.prefetch import Prefetch
from coordinator.observe.stats import Counts

log = logging.getLogger(__name__)

#: Longest a compile waits for the set-up's thread (then it goes on beside it).
WAIT_S = 120.0


class SetUpCounts(Counts, seconds=0.0, waited_s=0.0, skipped="", steps=dict):
    """The set-up's ``seconds`` on its thread (each step's in ``steps``: those it took before
    a compile started), the seconds a compile ``waited_s`` for the step under way, and why
    there was no set-up (``skipped``)."""


class InductorSetUp(Feature, counts=SetUpCounts):
    """Inductor's one-time set-up in a thread of its own, until the rank's first compile."""

    name = "inductor_setup"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def hooks(self, routed: frozenset[str]) -> Iterable[contextlib.AbstractContextManager[None]]:
        return (self._compiles_stop_it(),)

    @contextlib.contextmanager
    def _compiles_stop_it(self) -> Iterator[None]:
        remove = _compat.on_compile_start(self.stop)
        try:
            yield
        finally:
            remove()
            self._stop.set()

    def started(self) -> None:
        prefetch = self.context.feature(Prefetch)
        if prefetch is not None and prefetch.expects_entries(INDEX_WAIT_S):
            self.counts.skipped = "a restart"
            return
        import torch

        gpu = torch.cuda.is_available()  # asks the driver; no context is made
        self._thread = threading.Thread(target=self._set_up, args=(gpu,), name="coordinator-setup", daemon=True)
        self._thread.start()

    def _set_up(self, gpu: bool) -> None:
        began = time.perf_counter()
        steps = _compat.set_up_inductor(gpu, self._stop)
        self.counts.seconds = round(time.perf_counter() - began, 3)
        self.counts.steps = {name: round(seconds, 3) for name, seconds in steps.items()}
        log.debug("compile_once: Inductor's set-up took %.1fs: %s", self.counts.seconds, self.counts.steps)

    def stop(self) -> None:
        """A compile starts: the set-up takes no further step; wait for the one under way."""
        self._stop.set()
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return
        began = time.perf_counter()
        thread.join(WAIT_S)
        self.counts.waited_s = round(self.counts.waited_s + time.perf_counter() - began, 3)
        if thread.is_alive():
            log.warning("compile_once: a step of Inductor's set-up still runs after %.0fs; compiling beside it",
                        WAIT_S)
