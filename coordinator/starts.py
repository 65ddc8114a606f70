"""A session's start in parts, each at the first sign that it is needed.

Entering ``compile_once`` (``coordinator-run`` enters it as the script's ``import torch``
ends) checks the settings and installs the triggers below; nothing else: no Dynamo or
Inductor module is imported, no thread or process starts, no store is opened, CUDA is not
initialised and no environment variable changes. A process that compiles nothing pays
nothing more. The session's parts (``coordinator.features.base.Part``) start at their
triggers:

* **the compile part**, when the script calls ``torch.compile`` (the function torch exports,
  which ``nn.Module.compile`` and ``torch.compiler.compile`` call too), before the call goes
  on: the compile features and their hooks, Inductor's cache routing
  (``coordinator.inductor.compile_hooks``), the core below, and on a GPU the compile workers
  (``coordinator.features.compile_workers``). A script calls ``torch.compile`` before it
  builds DDP and its optimizer: the workers start, and a restart's entries are fetched,
  while it does, and its first frame finds them. A call made while a module is imported (a
  library's ``@torch.compile``, whose function may never run) or naming another backend than
  Inductor is no sign. A frame that reaches Dynamo without a sign before it
  (``torch._dynamo.optimize``, such a decorated function, a ``torch.compile`` bound before
  the session began) starts the part in Dynamo's start callback
  (``_compat.on_compile_start``), before the frame is traced.
* **the Triton part**, once Triton is imported (at once where it already is): Triton's
  cache manager and autotuner are the session's (``coordinator.features.triton_kernels``).
  Their first lookup, at Triton's first compile or tuning, starts the core.
* **the core** (what serves every lookup: the prefetch, the persistent layer), with the
  compile part or at the session's first lookup (``Session.get``/``put``).

Why a hook installed this late misses no entry: Inductor's caches (FX graphs, AOTAutograd,
autotuning, Dynamo's profiles) are asked only inside a compile Dynamo runs, and Dynamo
runs its start callbacks before it traces a frame, and before a lazy backward compile: the
compile part is in before the first lookup of any of them, whichever trigger fired. Triton
asks its cache manager for every compile, host module and autotune result
(``get_cache_manager``), and reads the manager's class when it asks; the class is the
session's from the moment Triton's module has run, before any of its code can compile, and
an autotuner's launch is wrapped from then too, so the first tuning is looked up like any
other. What compiles outside both is compiled as without the coordinator, and shared with
no rank: Inductor called on an FX graph directly (``torch._inductor.compile``, AOTInductor),
Triton kernels compiled before the session began, and Inductor's compile workers (other
processes, with Triton's own cache manager; their kernels travel in FX entries).

A part whose start fails is logged once and left off: the process compiles as without it.
:meth:`SessionStarts.close` removes the triggers and every hook the parts installed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from coordinator import _compat
from coordinator._compat.imports import AfterImport
from coordinator.features import Part
from coordinator.inductor import compile_hooks
from coordinator.session import Session

log = logging.getLogger(__name__)


class SessionStarts:
    """The triggers of one session's parts, and the hooks each part installed."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.RLock()
        #: The hooks of each part started, removed in the reverse order.
        self._hooks = contextlib.ExitStack()
        #: The parts whose start began (a failed one is not tried again), and those whose
        #: start is over: another thread's trigger waits for a start under way.
        self._began: set[Part] = set()
        self._over: set[Part] = set()
        self._finders: list[AfterImport] = []
        self._compile: Callable[..., Any] | None = None  # torch.compile as it was
        self._wrapper: Callable[..., Any] | None = None  # and as the triggers made it
        self._remove_dynamo_callback: Callable[[], None] | None = None

    # -- the triggers -----------------------------------------------------------------------

    def __enter__(self) -> SessionStarts:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(self) -> None:
        """Install the triggers (cheap: no module of Dynamo, Inductor or Triton imported)."""
        import torch

        original = torch.compile

        @functools.wraps(original)
        def compile(*args: Any, **kwargs: Any) -> Any:
            if _a_sign(kwargs):
                self.start(Part.COMPILE, "torch.compile")
            return original(*args, **kwargs)

        self._compile = original
        torch.compile = compile
        self._wrapper = compile
        self._finders = [AfterImport("torch._dynamo", self._dynamo_imported)]
        if importlib.util.find_spec("triton") is not None:
            self._finders.append(AfterImport("triton", self._triton_imported))
        for finder in self._finders:
            finder.install()

    def _triton_imported(self) -> None:
        # Triton may be imported by a thread while another starts a part (whose imports may
        # need Triton's module): that start is not waited for here, under Triton's import
        # lock; a thread of its own starts the Triton part once it is done.
        self.start(Part.TRITON, "import triton", wait=False)

    def _dynamo_imported(self) -> None:
        try:
            self._remove_dynamo_callback = _compat.on_compile_start(
                functools.partial(self.start, Part.COMPILE, "a frame reached Dynamo"))
        except Exception as exc:  # the torch.compile trigger still works
            log.warning("compile_once: could not hook Dynamo's compile start (%s)", exc)

    # -- the parts ---------------------------------------------------------------------------

    def start(self, part: Part, sign: str, *, wait: bool = True) -> None:
        """Start ``part`` (at ``sign``, which the debug line names), once; never raises.
        Without ``wait``, where another thread is starting a part, a thread of its own
        starts this one once that is done."""
        if part in self._over:
            return
        if not self._lock.acquire(blocking=wait):
            threading.Thread(target=self.start, args=(part, sign), name="coordinator-start", daemon=True).start()
            return
        try:
            if part not in self._began:  # else it is over, or under way on this thread
                self._began.add(part)
                try:
                    self._start(part, sign)
                finally:
                    self._over.add(part)
        finally:
            self._lock.release()

    def _start(self, part: Part, sign: str) -> None:
        log.debug("compile_once: %s: starting the session's %s part", sign, part.value)
        hooks = contextlib.ExitStack()
        try:
            on = self.session.enable(part)
            routed = self.session.routed if part is Part.COMPILE else frozenset()
            for feature in on:
                for hook in feature.hooks(routed):
                    hooks.enter_context(hook)
            if part is Part.COMPILE:
                for hook in compile_hooks(self.session):
                    hooks.enter_context(hook)
        except Exception:
            hooks.close()
            log.warning("compile_once: could not start the session's %s part; compiling as without it",
                        part.value, exc_info=True)
            return
        self._hooks.push(hooks.pop_all())
        for feature in on:
            try:
                feature.started()
            except Exception:  # the others go on
                log.warning("compile_once: %s did not start", feature.name or type(feature).__name__,
                            exc_info=True)

    def close(self) -> None:
        """Remove the triggers and every part's hooks."""
        with self._lock:
            self._began.update(Part)  # a trigger that fires from now on starts nothing
            self._over.update(Part)
        for finder in self._finders:
            finder.leave()
        import torch

        if self._compile is not None and torch.compile is self._wrapper:
            torch.compile = self._compile
        if self._remove_dynamo_callback is not None:
            self._remove_dynamo_callback()
        self._hooks.close()


def _a_sign(kwargs: dict[str, Any]) -> bool:
    """Whether a ``torch.compile`` call is a sign that Inductor compiles soon: not where a
    module is being imported (a library's decorator, whose function may never run: its first
    frame, if it comes, starts the part), nor with another backend named (``eager``,
    ``aot_eager``: Inductor does not run)."""
    backend = kwargs.get("backend", "inductor")
    if isinstance(backend, str) and backend != "inductor":
        return False
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):
            return False
        frame = frame.f_back
    return True
