"""Hooks on modules a process may never import: run once the module has been imported.

A session patches some torch modules that a job imports only when it needs them (Dynamo,
Inductor's template selection) and Triton, which only some jobs use. Importing such a module
to patch it would cost every job that never needs it its import (Inductor's template
selection: about a second on the CPU machines): :class:`AfterImport` runs a function once
the module has run instead (at once where it is imported already), and
:func:`once_imported` keeps a patch in from then until the end of a ``with`` block. Not a
private name of torch: Python's import system (a finder first on ``sys.meta_path`` that wraps
the module's loader), used only to hook torch's and Triton's modules.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class AfterImport:
    """A meta path finder that finds module ``name`` as the finders after it would and wraps
    the spec's loader, so that ``then`` runs once the module has run. It stays first on
    ``sys.meta_path`` until then (or :meth:`leave`): a library that only asks whether the
    module is installed (``importlib.util.find_spec``) gets a wrapped spec that never runs."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then
        self._finding = threading.local()
        self._done = False
        self._lock = threading.Lock()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name or getattr(self._finding, "now", False):
            return None
        self._finding.now = True  # the finders after this one find it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.now = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not a module this can wrap: the import goes on as without it
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            self.imported()

        spec.loader.exec_module = exec_module
        return spec

    def install(self) -> None:
        """First on ``sys.meta_path``; where the module is imported already, ``then`` runs now."""
        if self.name in sys.modules:
            self.imported()
        else:
            sys.meta_path.insert(0, self)

    def imported(self) -> None:
        """The module has run: leave ``sys.meta_path`` and run ``then``, once."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.leave()
        self.then()

    def leave(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


@contextlib.contextmanager
def once_imported(name: str, patch: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """For the duration, ``patch()`` is in from the moment module ``name`` is imported (now,
    if it is); a module never imported is never patched, nor imported."""
    entered = contextlib.ExitStack()
    lock = threading.Lock()
    ended = False

    def then() -> None:
        with lock:
            if not ended:
                entered.enter_context(patch())

    finder = AfterImport(name, then)
    finder.install()
    try:
        yield
    finally:
        finder.leave()
        with lock:
            ended = True
            entered.close()
