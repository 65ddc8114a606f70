"""Guards against wrong results and hangs: reads of the rank during a compile, and
Inductor switches that run collectives inside a compile.

Private names: reads of the rank (:func:`rank_reads`: ``torch.distributed.get_rank``,
``ProcessGroup.rank``; the reads of ``fx_passes/bucketing.py``, ``decomp_comms``,
``ddp_fusion``, ``select_algorithm``, ``_logging/_internal.py``, whose log formatter reads the
rank for each record, found by the GPU tier's max-autotune case on 2.11.0, and
``_dynamo/repro/after_aot.py``, whose repro script of each graph records ranks) and
in-compile collectives (:func:`collective_switches_off`: ``distributed_max_autotune_gemm``,
``distributed_runtime_autotune``, ``aten_distributed_optimizations.spmd_check``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from coordinator._compat.caches import _import

log = logging.getLogger(__name__)

#: Inductor switches that run collectives inside a compile. Under ``compile_once`` one
#: rank compiles each graph while the others load it, so those collectives would never
#: be joined: ``distributed_max_autotune_gemm`` (an ``all_gather_object`` of GEMM timings
#: in the scheduler, 2.13), ``distributed_runtime_autotune`` (store votes, then
#: collectives; releases after 2.13), and the SPMD check's ``all_gather_object`` of graph
#: hashes. Dotted names are attributes of ``torch._inductor.config``.
COLLECTIVE_SWITCHES = (
    "distributed_max_autotune_gemm",
    "distributed_runtime_autotune",
    "aten_distributed_optimizations.spmd_check",
)


def _config_attr(path: str) -> tuple[Any, str] | None:
    obj = _import("torch._inductor.config")
    *parents, name = path.split(".")
    for part in parents:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return (obj, name) if hasattr(obj, name) else None


@contextlib.contextmanager
def collective_switches_off() -> Iterator[list[str]]:
    """Turn off the switches of ``COLLECTIVE_SWITCHES`` that are on (with one warning
    each) for the duration; yields their names and restores them on exit."""
    turned_off: list[tuple[Any, str, Any, str]] = []
    for path in COLLECTIVE_SWITCHES:
        found = _config_attr(path)
        if found is None or not getattr(*found):
            continue
        obj, name = found
        turned_off.append((obj, name, getattr(obj, name), path))
        setattr(obj, name, False)
        log.warning(
            "compile_once: turned off torch._inductor.config.%s while compile_once is active: it runs "
            "collectives inside a compile, and under compile_once one rank compiles each graph while the "
            "others load it, so those collectives would wait forever", path,
        )
    try:
        yield [path for *_, path in turned_off]
    finally:
        for obj, name, value, _ in reversed(turned_off):
            setattr(obj, name, value)


#: Modules whose reads of the rank never change a graph's code: torch.distributed's own
#: bookkeeping, logging (torch's log formatter prefixes every record with the rank once
#: a process group exists), the repro script Inductor writes for every graph it compiles
#: (``save_graph_repro`` records each process group's rank), the profiler, and the
#: coordinator.
RANK_READS_IGNORED_MODULES = ("torch.distributed", "torch._logging", "torch._dynamo.repro", "torch.profiler",
                              "torch.utils.debug_log", "logging", "coordinator")
#: Reads of the rank that only decide whether to log: (module, function).
RANK_READS_FOR_LOGGING = frozenset({
    ("torch._inductor.fx_passes.ddp_fusion", "_bucket_size_fusion"),
    ("torch._inductor.select_algorithm", "log_results"),
})


@contextlib.contextmanager
def rank_reads(on_read: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_read(where)`` whenever code reads this process's rank through
    ``torch.distributed.get_rank`` or a ``ProcessGroup``'s ``rank()``; ``where`` is the
    caller's ``module.function``. Reads by the modules of ``RANK_READS_IGNORED_MODULES``
    and the logging-only reads of ``RANK_READS_FOR_LOGGING`` are not reported.

    Inductor passes that bake the rank into a graph's code read it this way: the
    all-gather bucketing of ``fx_passes/bucketing.py`` (``dist.get_rank(group)``),
    ``decomp_comms`` (``group.rank()``), and any custom pass that calls
    ``dist.get_rank()``. A module that bound ``get_rank`` by name before this starts, or
    that reads ``RANK`` from the environment, is not seen.
    """
    import sys

    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    original_get_rank = c10d.get_rank
    original_group_rank = dist.ProcessGroup.rank
    group_rank_descriptor = dist.ProcessGroup.__dict__["rank"]

    def report() -> None:
        frame = sys._getframe(2)
        module = frame.f_globals.get("__name__", "")
        if any(module == name or module.startswith(name + ".") for name in RANK_READS_IGNORED_MODULES):
            return
        if (module, frame.f_code.co_name) in RANK_READS_FOR_LOGGING:
            return
        on_read(f"{module}.{frame.f_code.co_name}")

    def get_rank(*args: Any, **kwargs: Any) -> int:
        report()
        return original_get_rank(*args, **kwargs)

    def group_rank(self: Any) -> int:
        report()
        return original_group_rank(self)

    get_rank.__doc__ = original_get_rank.__doc__
    dist.get_rank = c10d.get_rank = get_rank
    dist.ProcessGroup.rank = group_rank
    try:
        yield
    finally:
        dist.get_rank = c10d.get_rank = original_get_rank
        dist.ProcessGroup.rank = group_rank_descriptor
