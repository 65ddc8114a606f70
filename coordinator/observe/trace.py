"""A rank's coordinator events on a timeline: claims, compiles, waits, receives.

Every event a session emits is counted: its :class:`~coordinator.observe.stats.Stats` reads the
same events (``Stats.count``) that ``coordinator report`` reads back from the trace, so the
rank's summary and the report count the same things the same way. Writing them is off by
default. A session writes events when its ``trace_dir`` setting is set (its variable,
``coordinator-run --coordinator-trace DIR``) or torch's structured trace is on
(``TORCH_TRACE``); otherwise they are only counted. Parts used alone (a ``Singleflight``
in a test) hold :data:`NO_EVENTS`, whose methods do nothing.

* ``trace_dir``: each process writes ``DIR/rank<R>-<pid>.json``, Chrome trace events (a JSON
  array, one event per line, flushed as it goes: a job that hangs or is killed still leaves
  a file that Perfetto and ``coordinator report`` read; the closing bracket is optional in
  the format). ``coordinator report DIR`` merges the ranks (``coordinator.observe.report``).
* ``TORCH_TRACE``: the same events go into torch's structured trace
  (``_compat.emit_structured``), so tlparse shows them on each rank's page and in its
  timeline beside Dynamo's and Inductor's own.

Every event has ``cat`` ``"coordinator"``, a wall-clock ``ts`` in microseconds (ranks on
one host, or hosts whose clocks agree, line up), and ``args``. The names:

=================  =====  ===============================================================
name               phase  args
=================  =====  ===============================================================
session            i      host, pid, world_size
claim              i      key (``<cache kind>/<digest>``)
compile            X      key: from this rank's miss to Inductor's entry (saved: false when
                          the compile ended without one)
publish            i      key, bytes, ok, local_copy (a graph from this rank's local cache)
wait               X      key, owner (a rank) and ended (received, took over, owner gave up,
                          timed out) for a wait on the store; via "node lock" and ended
                          (received: the node's copy, or asked the store) for a wait on
                          another process of this node that was fetching it
receive            X      key, bytes, from (store or node), saved_s (the compile time its
                          entry records, where it counts: ``Stats``), kernels: the lookup
local hit          i      key: a graph this rank found in its own local cache; from
                          ("bundle") and saved_s where a bundle installed it there
rejected           i      key, why
early backward     X      outcome (compiled, skipped, failed)
share              X      key (the slot, ``split_share/<digest>``), frame, index, outcome
                          (compiled, skipped, failed): a submodule of a split frame this rank
                          compiled for the job (``coordinator.features.split_shares``)
chain              i      key, frame, index, outcome (served, missed): the chain of a split
                          frame found that submodule's AOTAutograd entry, or compiled it
timeout extension  i      seconds
store lost         i      error
step               i      n: a ``torch.optim`` optimizer's step returned (the first three,
                          then those after a step with other events)
=================  =====  ===============================================================

Events logged inside a compile carry Dynamo's ``compile_id`` (as tlparse names compiles).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator import _compat

log = logging.getLogger(__name__)

#: How a wait ended, by Singleflight's outcome.
WAIT_ENDINGS = {"waited": "received", "expired": "took over", "abandoned": "owner gave up", "deadline": "timed out"}


def short_key(store_key: str) -> str:
    """``<cache kind>/<digest>`` of a store key (``<fingerprint>/<secret>/<namespace>/<kind>/<digest>``)."""
    return "/".join(store_key.rsplit("/", 2)[-2:])


class NoEvents:
    """Events neither counted nor written: every event is dropped at the cost of a call."""

    active = False

    def instant(self, name: str, **args: Any) -> None:
        pass

    def span(self, name: str, started: float, **args: Any) -> None:
        pass

    def compile_began(self, key: str) -> None:
        pass

    def compile_ended(self, key: str) -> None:
        pass

    def compiles_ended(self, kind: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass


NO_EVENTS = NoEvents()


class Events(NoEvents):
    """One process's coordinator events: each counted by ``count``, and written to
    ``trace_dir`` and/or torch's trace when tracing is on (``active``)."""

    def __init__(self, rank: Callable[[], int], trace_dir: Path | None, *, structured: bool,
                 count: Callable[[dict], None] | None = None) -> None:
        self._rank = rank  # known once the process group is
        self._dir = trace_dir
        self._structured = structured
        self._count = count
        self.active = trace_dir is not None or structured
        self._lock = threading.Lock()
        self._file = None
        self._threads: dict[int, int] = {}
        self._compiling: dict[str, list[float]] = {}
        self._started = time.time()
        self._steps = 0
        self._busy = False  # events since the last step
        self._step_hook = _register_step_hook(self._stepped) if self.active else None

    # -- what the session calls --------------------------------------------------------

    def instant(self, name: str, **args: Any) -> None:
        self._emit({"name": name, "ph": "i", "s": "t", "ts": time.time() * 1e6}, args)

    def span(self, name: str, started: float, **args: Any) -> None:
        """An event from wall-clock time ``started`` (``time.time()``) until now."""
        now = time.time()
        self._emit({"name": name, "ph": "X", "ts": started * 1e6, "dur": max(now - started, 0.0) * 1e6}, args)

    def compile_began(self, key: str) -> None:
        """This rank missed ``key`` and compiles it now."""
        with self._lock:
            self._compiling.setdefault(short_key(key), []).append(time.time())

    def compile_ended(self, key: str) -> None:
        """Inductor handed over ``key``'s entry: the compile span ends."""
        self._end_compile(short_key(key), saved=True)

    def compiles_ended(self, kind: str | None = None) -> None:
        """Every compile of cache ``kind`` (``None``: of any) still open has ended without
        an entry (Inductor bypassed the cache, or the compile failed): their spans end now."""
        with self._lock:
            keys = [key for key in self._compiling if kind is None or key.startswith(kind + "/")]
        for key in keys:
            while self._end_compile(key, saved=False):
                pass

    def _end_compile(self, key: str, *, saved: bool) -> bool:
        with self._lock:
            began = self._compiling.get(key)
            if not began:
                return False
            started = began.pop(0)
            if not began:
                del self._compiling[key]
        if saved:
            self.span("compile", started, key=key)
        else:
            self.span("compile", started, key=key, saved=False)
        return True

    def close(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- internals ---------------------------------------------------------------------

    def _stepped(self, *_: Any) -> None:
        self._steps += 1
        if self._steps <= 3 or self._busy:
            self.instant("step", n=self._steps)
        self._busy = False

    def _emit(self, event: dict[str, Any], args: dict[str, Any]) -> None:
        event.update(cat="coordinator", args=args)
        if self._count is not None:
            self._count(event)
        if not self.active:
            return
        compile_id = _compat.current_compile_id()
        if compile_id is not None:
            args["compile_id"] = compile_id
        self._busy = event["name"] != "step"
        if self._structured:
            _compat.emit_structured(event)
        if self._dir is None:
            return
        with self._lock:
            try:
                if self._file is None:
                    self._file = self._open()
                tid = self._threads.setdefault(threading.get_ident(), len(self._threads))
                self._file.write(json.dumps(dict(event, pid=self._pid, tid=tid)) + ",\n")
                self._file.flush()
            except OSError as exc:  # never fail a compile over its trace
                log.warning("compile_once: cannot write the trace to %s (%s); tracing off", self._dir, exc)
                self._dir = None

    def _open(self):
        rank = int(self._rank())
        self._pid = rank
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"rank{rank}-{os.getpid()}.json"
        file = open(path, "w", buffering=1)
        file.write("[\n")
        for meta in ({"name": "process_name", "args": {"name": f"rank {rank}"}},
                     {"name": "process_sort_index", "args": {"sort_index": rank}}):
            file.write(json.dumps(dict(meta, ph="M", pid=rank, tid=0)) + ",\n")
        session = {"name": "session", "ph": "i", "s": "t", "ts": self._started * 1e6, "pid": rank, "tid": 0,
                   "cat": "coordinator",
                   "args": {"host": socket.gethostname(), "pid": os.getpid(),
                            "world_size": int(os.environ.get("WORLD_SIZE", "1"))}}
        file.write(json.dumps(session) + ",\n")
        log.debug("compile_once: tracing to %s", path)
        return file


def _register_step_hook(callback: Any) -> Any:
    """Mark each optimizer step (a public torch hook, global to the process)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(callback)


def open_events(trace_dir: Path | None, rank: Callable[[], int], count: Callable[[dict], None]) -> Events:
    """The session's events, each counted by ``count``; written into ``trace_dir`` if set,
    and into torch's structured trace if that is on."""
    return Events(rank, trace_dir, structured=_compat.structured_trace_on(), count=count)
