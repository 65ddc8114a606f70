"""Triton's CUDA driver utilities, built before the first kernel load needs them.

The first time a process makes Triton's CUDA driver (at its first kernel load), Triton
compiles a small C module, ``cuda_utils`` (loading cubins, device properties, launches),
into its cache dir with the host's C compiler, unless the dir already holds it. A restart
on an empty cache dir pays that build inside its first graph's load.
:func:`warm_driver_utilities` builds it in a background thread when a session's compile
part starts (the script called ``torch.compile``), where Triton would build it then: its
own cache dir (``TRITON_CACHE_DIR`` as the process has it; this sets nothing), through
the session's Triton cache manager where that is in (``coordinator.features.triton_kernels``:
a rank on empty dirs loads the module another rank built). Triton's cache is keyed by the
module's source, so a build that races the driver's own only writes the same file twice.
Only where the process sees one CUDA GPU (``coordinator-run`` and ``torchrun
--virtual-local-rank`` show each worker its GPU as device 0).

Private names: ``triton.backends.nvidia.driver.CudaUtils`` (a singleton whose constructor
builds and loads ``cuda_utils``). Triton 3.6 (torch 2.11, H100 and H200; on an H100, the
restart benchmark) and 3.8 (torch 2.14.1's CUDA build, read, not run: no GPU on the CPU
machines).
"""

from __future__ import annotations

import logging
import threading

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

    def build() -> None:
        try:
            CudaUtils()
        except Exception as exc:  # Triton builds it again where it needs it
            log.debug("compile_once: could not build Triton's driver utilities early: %s", exc)

    thread = threading.Thread(target=build, name="coordinator-triton-driver", daemon=True)
    thread.start()
    return thread
