"""Inductor's GEMM template selection: each choice compiled once.

Before timing a selection's choices, Inductor precompiles them in parallel
(``AlgorithmSelectorCache.make_precompile_fn``): a Triton template choice goes to its
compile workers once they are up (``AsyncCompile.use_process_pool()``), any other to
threads of this process. On torch 2.11 the timing that follows does not find the
workers' kernels (other Triton cache keys: the recompile probe, ``benchmarks/RESULTS.md`` at ddb6d09) and
compiles each choice again, one at a time, in the rank's own thread: most of a
max-autotune compile. :func:`precompile_choices_in_process` sends a selection's
precompiles to the threads instead, whose kernels the timing then uses.

Private names (patched once Inductor imports ``select_algorithm``):
``AlgorithmSelectorCache.make_precompile_fn``, ``AsyncCompile.use_process_pool``, a
classmethod, asked inside it. Ran on 2.11.0 on an H100: the recompile probe and the
max-autotune benchmark.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

from coordinator._compat.imports import once_imported

log = logging.getLogger(__name__)

_precompiling = threading.local()


def precompile_choices_in_process() -> contextlib.AbstractContextManager[None]:
    """While active, a template selection's precompiles run in threads of this process
    (Inductor's path when its compile workers are not up), never in the workers. Patched
    once Inductor imports its template selection (``select_algorithm``), which a job that
    selects no template never imports."""
    return once_imported("torch._inductor.select_algorithm", _precompiles_in_process)


@contextlib.contextmanager
def _precompiles_in_process() -> Iterator[None]:
    try:
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.select_algorithm import AlgorithmSelectorCache
    except ImportError:
        yield
        return
    original_make = AlgorithmSelectorCache.__dict__.get("make_precompile_fn")
    original_use_pool = AsyncCompile.__dict__.get("use_process_pool")
    if not callable(original_make) or not isinstance(original_use_pool, classmethod):
        log.debug("make_precompile_fn or AsyncCompile.use_process_pool not found; precompiles stay as they are")
        yield
        return
    use_pool = original_use_pool.__func__

    @functools.wraps(original_make)
    def make_precompile_fn(self, *args, **kwargs):
        depth = getattr(_precompiling, "depth", 0)
        _precompiling.depth = depth + 1
        try:
            return original_make(self, *args, **kwargs)
        finally:
            _precompiling.depth = depth

    def use_process_pool(cls):
        if getattr(_precompiling, "depth", 0):
            return False
        return use_pool(cls)

    AlgorithmSelectorCache.make_precompile_fn = make_precompile_fn
    AsyncCompile.use_process_pool = classmethod(use_process_pool)
    try:
        yield
    finally:
        AlgorithmSelectorCache.make_precompile_fn = original_make
        AsyncCompile.use_process_pool = original_use_pool


def device_name() -> str:
    """A name for this process's device, the same in every process that uses it."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    try:
        return f"cuda-{torch.cuda.get_device_properties(index).uuid}"
    except Exception:
        return f"cuda-{index}"
