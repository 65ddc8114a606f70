"""Inductor's one-time set-up in a process, done ahead of its first compile.

A process's first Inductor compile pays for things that every later compile finds done:
Inductor's modules imported, torch's build hash that every cache key holds
(``codecache.torch_key``), and on a GPU the modules that generate and launch Triton kernels
(imported with no CUDA call: a thread of a rank must not make a context on another rank's
device). Each step is one that torch's first compile, hit or miss, takes itself, in the
same call, so taking it earlier changes no result.

Left to the compile: the pattern matcher's patterns (their tracing sets FX's process-wide
tracing state, which a module call on another thread then meets: Dynamo refuses to run a
compiled function under FX tracing), and the CPU's vector-ISA probes (a rank that receives
its first graph receives the probes' libraries with it, ``_compat.cpu_isa``).

:func:`set_up` stops between steps once asked to (``stop``), and the caller makes a compile
wait for the step under way (``coordinator.features.inductor_setup``): no import runs beside
a compile's tracing.

Private names: ``torch._inductor.compile_fx`` (imported),
``torch._inductor.codecache.torch_key``, ``torch._inductor.codegen.triton`` and
``torch._inductor.runtime.triton_heuristics`` (imported). Read from 2.13.0's source; ran on
2.13.0 and 2.14.1 (CPU tests). A step this torch lacks is skipped.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _import(name: str) -> Callable[[], object]:
    return lambda: importlib.import_module(name)


def _call(module: str, function: str) -> Callable[[], object]:
    return lambda: getattr(importlib.import_module(module), function)()


def steps(gpu: bool) -> list[tuple[str, Callable[[], object]]]:
    """The set-up's steps, in the order a compile needs them: (name, what runs)."""
    found = [
        ("import compile_fx", _import("torch._inductor.compile_fx")),
        ("torch_key", _call("torch._inductor.codecache", "torch_key")),
    ]
    if gpu:
        found += [("import Triton codegen", _import("torch._inductor.codegen.triton")),
                  ("import Triton heuristics", _import("torch._inductor.runtime.triton_heuristics"))]
    return found


def set_up(gpu: bool, stop: threading.Event) -> dict[str, float]:
    """Run the steps (``gpu``: those of a process that compiles for a GPU) until ``stop`` is
    set; the seconds each step taken took. A step that fails is logged and skipped: the
    first compile takes it again."""
    seconds: dict[str, float] = {}
    for name, step in steps(gpu):
        if stop.is_set():
            break
        began = time.perf_counter()
        try:
            step()
        except Exception as exc:  # the first compile does it, as without the set-up
            log.debug("compile_once: Inductor's set-up step %r failed: %s", name, exc)
            continue
        seconds[name] = time.perf_counter() - began
    return seconds
