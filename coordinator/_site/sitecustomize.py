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


class _AfterTorchImport:
    """A meta path finder that finds ``torch`` once, as the finders after it would, and has
    its loader call ``then`` when torch's module has run."""

    def __init__(self, then) -> None:
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            self.then()  # a torch we cannot wrap: enter now, as before the import
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            self.then()

        spec.loader.exec_module = exec_module
        return spec


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
        sys.meta_path.insert(0, _AfterTorchImport(_enter))


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
