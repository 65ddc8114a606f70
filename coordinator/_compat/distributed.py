"""torch.distributed internals: the default store, NCCL process groups and the
ephemeral NCCL timeout extension.

NCCL timeouts (:func:`extend_nccl_timeouts`, :func:`has_nccl_process_group`) and the default
store (:func:`default_c10d_store`). Private names: ``distributed_c10d._get_default_store``,
``distributed_c10d._world.pg_map``, a process group's ``_device_types`` and ``_get_backend``,
``distributed_c10d._add_ephemeral_timeout_for_all_pgs``. Ran on 2.11.0 on GPUs.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

def default_c10d_store() -> Any | None:
    """The store behind the default process group, or ``None`` if there is none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def has_nccl_process_group() -> bool:
    """Whether an initialized process group runs on CUDA devices (NCCL)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_nccl_available():
        return False
    from torch.distributed import ProcessGroupNCCL

    cuda = torch.device("cuda")
    for pg in dist.distributed_c10d._world.pg_map:
        if cuda in getattr(pg, "_device_types", ()) and isinstance(pg._get_backend(cuda), ProcessGroupNCCL):
            return True
    return False


def extend_nccl_timeouts(seconds: float) -> float:
    """Extend this rank's NCCL timeouts until its next collective completes.

    Returns the seconds added (0 when there is no NCCL process group).
    """
    whole = int(seconds)
    if whole <= 0 or not has_nccl_process_group():
        return 0.0
    import torch.distributed as dist

    dist.distributed_c10d._add_ephemeral_timeout_for_all_pgs(timedelta(seconds=whole))
    return float(whole)
