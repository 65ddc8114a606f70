"""Turn compile_once on in a Python process from environment variables alone.

``coordinator-run`` puts this directory first on the workers' ``PYTHONPATH`` and turns
the ``enable`` setting on (plus any other settings, ``coordinator.settings``): every worker
then runs under ``coordinator.compile_once()`` for its whole life, with no change to the
training script. The store is opened at the first compile, after the script has
called ``init_process_group``. A site's own ``sitecustomize`` further down the path
still runs.

Only the worker itself enters ``compile_once``: this directory leaves ``PYTHONPATH`` and
the switch leaves the environment before the worker starts any process of its own.
Inductor starts many (compile workers, and a Python process per CPU-feature probe):
each would otherwise import torch and Inductor at its start, seconds apiece, on the
compiling rank's critical path.
"""

import os
import sys


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
