"""Turn compile_once on in a Python process from environment variables alone.

``coordinator-run`` puts this directory first on the workers' ``PYTHONPATH`` and turns
the ``enable`` setting on (plus any other settings, ``coordinator.settings``): every worker
then runs under ``coordinator.compile_once()`` for its whole life, with no change to the
training script. It enters ``compile_once`` as the script's own ``import torch`` ends (a
finder first on ``sys.meta_path`` wraps torch's loader), not before the script's first
line: the process starts as fast as without the coordinator, and the coordinator's own
start (its imports, Inductor's compile workers, the prefetch of a restart's entries) comes
where the script pays for torch anyway. Where torch is already imported, it enters at once.
The store is opened at the first compile, after the script has called
``init_process_group``. A site's own ``sitecustomize`` further down the path still runs.

Only the worker itself enters ``compile_once``: this directory leaves ``PYTHONPATH`` and
the switch leaves the environment before the worker starts any process of its own.
Inductor starts many (compile workers, and a Python process per CPU-feature probe):
each would otherwise import torch and Inductor at its start, seconds apiece, on the
compiling rank's critical path.
"""

import os
import sys
import threading


class _AfterTorchImport:
    """A meta path finder that finds ``torch`` as the finders after it would and wraps the
    spec's loader, so that ``then`` runs once torch's module has run. It stays first on
    ``sys.meta_path`` until then: a library that only asks whether torch is installed
    (``importlib.util.find_spec("torch")``) gets a wrapped spec that never runs."""

    def __init__(self, then) -> None:
        self.then = then
        self._finding = threading.local()
        self._done = False
        self._lock = threading.Lock()

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or getattr(self._finding, "now", False):
            return None
        self._finding.now = True  # the finders after this one find it
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            self._finding.now = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not a torch this can wrap: the import goes on as without it
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            self.imported()

        spec.loader.exec_module = exec_module
        return spec

    def imported(self) -> None:
        """Torch's module has run: leave ``sys.meta_path`` and run ``then``, once."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.leave()
        self.then()

    def leave(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _leave_pythonpath() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [entry for entry in entries if entry and os.path.abspath(entry) != here]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)


def _enable() -> None:
    try:
        from coordinator.settings import enable_requested  # imports no torch: cheap while off

        if not enable_requested():  # enable_from_env reads its value
            return
    except Exception as exc:  # never stop the process from starting
        print(f"coordinator: not enabled: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    _leave_pythonpath()
    if "torch" in sys.modules:
        _enter()
    else:
        finder = _AfterTorchImport(_enter)
        sys.meta_path.insert(0, finder)
        # A process forked before torch is imported is not the worker: it enters nothing.
        os.register_at_fork(after_in_child=finder.leave)


def _enter() -> None:
    try:
        import coordinator

        coordinator.enable_from_env()
    except Exception as exc:  # never stop the worker from starting
        print(f"coordinator: not enabled: {type(exc).__name__}: {exc}", file=sys.stderr)


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.util

    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_site_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain_next_sitecustomize()
_enable()
