"""Triton's CUDA driver utilities, built before the first kernel load needs them.

The first time a process makes Triton's CUDA driver (at its first kernel load), Triton
compiles a small C module, ``cuda_utils`` (loading cubins, device properties, launches),
into its cache dir with the host's C compiler, unless the dir already holds it. A restart
on an empty cache dir pays that build inside its first graph's load. :func:`warm_driver_utilities`
builds it in a background thread when a session starts, into the dir Inductor will point
Triton at, so that the load finds it there. Triton's cache is keyed by the module's source,
so a build that races the driver's own only writes the same file twice.

Only where the process sees one CUDA GPU (``coordinator-run`` and ``torchrun
--virtual-local-rank`` show each worker its GPU as device 0): Inductor sets
``TRITON_CACHE_DIR``, when unset, to ``<Inductor cache dir>/triton/<device of the first
kernel>``, and with one device that is device 0, so it is set here the same way first.

Private names: ``triton.backends.nvidia.driver.CudaUtils`` (a singleton whose constructor
builds and loads ``cuda_utils``); Inductor's ``triton_cache_dir`` (``triton_tuning``).
Triton 3.6 (torch 2.11, H100 and H200) and 3.8 (torch 2.14.1's CUDA build, read, not run:
no GPU on the CPU machines).
"""

from __future__ import annotations

import logging
import os
import threading

from coordinator._compat.triton_tuning import triton_cache_dir

log = logging.getLogger(__name__)


def warm_driver_utilities() -> threading.Thread | None:
    """Start building Triton's CUDA driver utilities in a daemon thread; the thread, or
    ``None`` where the process has no single CUDA GPU or no Triton."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available() or torch.cuda.device_count() != 1:
        return None
    try:
        from triton.backends.nvidia.driver import CudaUtils
    except ImportError:
        return None
    if os.environ.get("TRITON_CACHE_DIR") is None:
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(0)

    def build() -> None:
        try:
            CudaUtils()
        except Exception as exc:  # Triton builds it again where it needs it
            log.debug("compile_once: could not build Triton's driver utilities early: %s", exc)

    thread = threading.Thread(target=build, name="coordinator-triton-driver", daemon=True)
    thread.start()
    return thread
