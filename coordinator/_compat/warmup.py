"""What Inductor does once per process, started when a session starts rather than inside
the first compile.

Plain ``torch.compile`` pays some one-time costs inside the first graph it compiles. Stock
pays them once per process, in its chain; a rank that compiles a share of a split frame
pays them in its first share, and every rank of the job pays them at the same moment, on
the job's critical path. Two of them need no compile to be paid, and wait on other
processes rather than on the interpreter, so they run beside the script's own start:

* :func:`warm_compile_pool`, on a GPU: Inductor compiles Triton kernels in a pool of worker
  processes, which plain ``torch.compile`` starts only when its first kernel asks whether
  the pool may be used (``AsyncCompile.use_process_pool``); until the workers are up, the
  first graph builds its kernels one by one in the main process. Inductor's own
  ``inductor`` backend module warms the pool when it is imported (``maybe_warm_pool``); this
  calls the same function. Torch's own switch turns it off: ``TORCH_WARM_POOL=0``.
* :func:`probe_cpu_isa`, on CPU: before its first C++ kernel, Inductor finds which vector
  instruction sets the CPU runs by building and loading a test library for each, in child
  processes (``cpu_vec_isa.valid_vec_isa_list``, cached for the process): seconds, most of
  them spent waiting on those children. It runs in a background thread.

Private names: ``torch._inductor.async_compile.maybe_warm_pool`` (``AsyncCompile.warm_pool``
and ``wakeup``), ``torch._inductor.cpu_vec_isa.valid_vec_isa_list``. Read from the sources of
2.11.0, 2.13.0 and 2.14.1; the pool ran on 2.11.0 on H200s (the split-cold benchmark), the
probe on 2.13.0 and 2.14.1 (CPU tests).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def _has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def warm_compile_pool() -> bool:
    """Start Inductor's compile worker pool now; returns whether it was asked to start
    (``False``: no CUDA GPU or no Triton here, or torch's ``TORCH_WARM_POOL=0``)."""
    if not _has_cuda() or os.environ.get("TORCH_WARM_POOL", "1") != "1":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
        from torch.utils._triton import has_triton_package
    except ImportError:
        return False
    if not has_triton_package():
        return False
    try:
        maybe_warm_pool()
    except Exception as exc:  # Inductor starts it at its first kernel, as without us
        log.debug("compile_once: could not start Inductor's compile workers early: %s", exc)
        return False
    return True


def probe_cpu_isa() -> threading.Thread | None:
    """Find the CPU's vector instruction sets in a daemon thread, as Inductor would before
    its first C++ kernel; the thread, or ``None`` where the process has a CUDA GPU (its
    graphs compile to Triton)."""
    if _has_cuda():
        return None
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:
        return None

    def probe() -> None:
        try:
            valid_vec_isa_list()
        except Exception as exc:  # Inductor probes again where it needs to
            log.debug("compile_once: could not probe the CPU's vector instructions early: %s", exc)

    thread = threading.Thread(target=probe, name="coordinator-cpu-isa", daemon=True)
    thread.start()
    return thread
