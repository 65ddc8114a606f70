"""Moving a bundle's bytes from one rank to every rank of a process group.

For large clusters NCCL moves the bytes down a tree at link speed instead of thousands
of ranks reading one store.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from coordinator.bundles.format import KernelRecord, pack_bundle, read_bundle
from coordinator.bundles.install import install_bundle
from coordinator.bundles.keys import bundle_settings, session_parts
from coordinator.settings import Config

log = logging.getLogger(__name__)

#: Broadcast in pieces of this size, so multi-GB bundles need bounded host and device memory.
BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024


def broadcast_bundle(src: int = 0, group: Any = None, *, secret: str | bytes | None = None,
                     config: Config | None = None, kernels: KernelRecord | None = None) -> dict:
    """Send rank ``src``'s bundle to every rank of ``group`` and install it there.

    Call it on all ranks at one point (after step 1, or after a warm-up). The bytes go
    over the process group: a CUDA uint8 tensor under NCCL, a CPU one under gloo, in
    chunks of ``BROADCAST_CHUNK_BYTES``. ``config`` gives the secret and ``kernels`` the
    kernels to carry (a session's; neither given: the session :mod:`coordinator.bundles.keys`
    finds).

    Returns:
        On ``src``: ``{"bytes"}``; elsewhere also what :func:`install_bundle` returns.
    """
    import torch.distributed as dist

    config, kernels = session_parts(config, kernels)
    secret = bundle_settings(secret, config=config)[0]
    blob = pack_bundle(secret=secret, kernels=kernels) if dist.get_rank() == src else None
    received, elapsed = broadcast_bytes(blob, src, group)
    result: dict = {"bytes": len(received if received is not None else blob), "broadcast_s": elapsed}
    if received is not None:
        result.update(install_bundle(read_bundle(received, secret=secret)))
        log.info("received a %.1f MB bundle from rank %d in %.2fs", len(received) / 1e6, src, elapsed)
    return result


def broadcast_bytes(blob: bytes | None, src: int = 0, group: Any = None) -> tuple[bytes | bytearray | None, float]:
    """Broadcast ``blob`` from rank ``src``; returns (bytes received or None on src, seconds).

    Under NCCL the bytes travel as CUDA uint8 tensors, in chunks of
    ``BROADCAST_CHUNK_BYTES`` so device memory stays bounded; under gloo as CPU tensors.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = torch.tensor([len(blob) if rank == src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    total = int(size.item())
    start = time.perf_counter()
    if total == 0:
        return (b"" if rank != src else None), 0.0
    if not cuda:
        # gloo broadcasts CPU tensors in place; it may write into what it sends: copy.
        if rank == src:
            host = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        else:
            host = torch.empty(total, dtype=torch.uint8)
        for offset in range(0, total, BROADCAST_CHUNK_BYTES):
            dist.broadcast(host[offset : offset + BROADCAST_CHUNK_BYTES], src, group=group)
        return (host.numpy().tobytes() if rank != src else None), time.perf_counter() - start

    # NCCL: host bytes -> pinned staging chunk -> device chunk -> broadcast -> pinned -> host.
    # One chunk-sized pinned buffer and one device buffer, reused: memory stays bounded.
    import numpy as np

    chunk_bytes = min(BROADCAST_CHUNK_BYTES, max(total, 1))
    staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    received = bytearray(total) if rank != src else None
    source = np.frombuffer(blob, dtype=np.uint8) if rank == src else None
    target = np.frombuffer(received, dtype=np.uint8) if received is not None else None
    for offset in range(0, total, chunk_bytes):
        n = min(chunk_bytes, total - offset)
        if rank == src:
            staging.numpy()[:n] = source[offset : offset + n]
            on_device[:n].copy_(staging[:n], non_blocking=True)
        dist.broadcast(on_device[:n], src, group=group)
        if rank != src:
            staging[:n].copy_(on_device[:n], non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            target[offset : offset + n] = staging.numpy()[:n]
        else:
            torch.cuda.current_stream(device).synchronize()
    return received, time.perf_counter() - start
