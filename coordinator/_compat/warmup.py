"""What Inductor does once per process, started when a session starts rather than inside
the first compile.

Plain ``torch.compile`` pays some one-time costs inside the first graph it compiles. Stock
pays them once per process, in its chain; a rank that compiles a share of a split frame
pays them in its first share, and every rank of the job pays them at the same moment, on
the job's critical path. One of them needs no compile to be paid, and waits on other
processes rather than on the interpreter, so it starts beside the script's own start: on a
GPU, Inductor compiles Triton kernels in a pool of worker processes, which plain
``torch.compile`` starts only when its first kernel asks whether the pool may be used
(``AsyncCompile.use_process_pool``); until the workers are up, the first graph builds its
kernels one by one in the main process. Inductor's own ``inductor`` backend module warms the
pool when it is imported (``maybe_warm_pool``); :func:`warm_compile_pool` calls the same
function. Torch's own switch turns it off: ``TORCH_WARM_POOL=0``.

On CPU nothing is warmed: Inductor builds C++ kernels in a thread pool, and the other
one-time cost of a CPU compile (the probe of the CPU's vector instructions, a test library
built and loaded per instruction set) runs child processes that, started with the script,
would compete with it for the cores.

Private names: ``torch._inductor.async_compile.maybe_warm_pool`` (``AsyncCompile.warm_pool``
and ``wakeup``). Read from the sources of 2.11.0, 2.13.0 and 2.14.1; ran on 2.11.0 on H200s
(the split-cold benchmark).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def warm_compile_pool() -> None:
    """Start Inductor's compile worker pool now, where a CUDA GPU is. Inductor's own
    function decides the rest as it would at import: no Triton, or ``TORCH_WARM_POOL=0``,
    starts nothing."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    except Exception as exc:  # Inductor starts it at its first kernel, as without us
        log.debug("compile_once: could not start Inductor's compile workers early: %s", exc)
