"""Turn compile_once on in a Python process from environment variables alone.

``coordinator-run`` puts this directory first on the workers' ``PYTHONPATH`` and turns the
``enable`` setting on (plus any other settings, ``coordinator.settings``): every worker then
runs under ``coordinator.compile_once()`` for its whole life, with no change to the training
script. As the interpreter starts, this takes the switch out of the environment and this
directory out of ``PYTHONPATH`` and ``sys.path``, so that the script's first line finds both
as under torchrun, and the processes the worker starts (Inductor's compile workers, its
CPU-feature probes, data loaders) enter nothing. It enters ``compile_once`` as the script's
own ``import torch`` ends (a finder wraps torch's loader:
``coordinator._compat.imports.AfterImport``), or at once where torch is already imported.
That entry checks the settings and installs the session's triggers, nothing more: the
session starts at the first sign of a compile (``coordinator.starts``). A site's own
``sitecustomize`` further down the path still runs.
"""

import os
import sys


def _leave_pythonpath() -> None:
    """Take this directory out of ``PYTHONPATH`` and ``sys.path``: the script finds them as
    it would under torchrun."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [entry for entry in entries if entry and os.path.abspath(entry) != here]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]


def _enable() -> None:
    try:
        from coordinator.settings import enable_requested, take_enable_switch  # imports no torch

        if not enable_requested():
            return
        on = take_enable_switch()  # out of the environment before the script's first line
    except Exception as exc:  # never stop the process from starting
        _leave_pythonpath()
        print(f"coordinator: not enabled: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    _leave_pythonpath()
    if not on:
        return
    from coordinator._compat.imports import AfterImport

    finder = AfterImport("torch", _enter)
    finder.install()
    # A process forked before torch is imported is not the worker: it enters nothing.
    os.register_at_fork(after_in_child=finder.leave)


def _enter() -> None:
    try:
        from coordinator.api import enter_for_process

        enter_for_process()
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
