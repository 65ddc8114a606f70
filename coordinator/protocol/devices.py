"""Which ranks of a job can share compiled graphs: those that compile for the same device index.

Inductor's keys and generated code carry the CUDA device index, so a rank on ``cuda:1``
can use nothing a rank on ``cuda:0`` compiled. Under plain ``torchrun`` a host's rank
``i`` runs on ``cuda:i`` and shares only with the ranks on ``cuda:i`` of other hosts;
``coordinator-run`` and ``torchrun --virtual-local-rank`` show every rank its GPU as
``cuda:0``, and every rank shares with every other.

When a rank opens the store it writes the index it compiles for under its job
(:meth:`DeviceIndices.publish`), and warns once if another rank's differs. What deals
work out among the ranks (``coordinator.features.split_shares``) deals it among the
ranks on its own index (:meth:`DeviceIndices.peers`), so that no rank waits for work
done under keys it can never use. A rank whose index cannot be read within a short wait
(it has not opened the store yet) counts as a peer: dealing it work costs at most the
grace the waiting rank gives an unclaimed share, as without this.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta

from coordinator.errors import StoreError
from coordinator.protocol.stores.base import Store

log = logging.getLogger(__name__)

#: How long a job's device indices stay in a store that expires keys.
INDEX_TTL = timedelta(days=1)
#: Between reads of the indices not written yet.
_POLL_S = 0.1


def current_index() -> str:
    """The device this process compiles for: its current CUDA device index, or ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return str(torch.cuda.current_device())


class DeviceIndices:
    """This job's ranks' device indices in ``store``, under ``prefix`` and the job."""

    def __init__(self, store: Store, prefix: str, job: str, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.index = current_index()
        self._base = f"{prefix}/device/{hashlib.sha256(job.encode()).hexdigest()[:24]}"
        #: rank -> the device index it wrote (read once: a rank's index does not change).
        self._indices: dict[int, str] = {}
        self._waited = False

    def key(self, rank: int) -> str:
        return f"{self._base}/{rank}"

    def publish(self) -> None:
        """Write this rank's index; warn once if the first other rank's differs (or this
        rank is not on ``cuda:0``, which a launch that shows each worker its GPU gives)."""
        peer = 1 if self.rank == 0 else 0
        try:
            self.store.set(self.key(self.rank), self.index.encode(), ttl=INDEX_TTL if self.store.expires else None)
            other = self.store.get(self.key(peer))
        except StoreError as exc:
            log.debug("compile_once: could not exchange device indices: %s", exc)
            return
        other_index = other.decode() if other is not None else None
        if self.index != "cpu" and (self.index != "0" or (other_index is not None and other_index != self.index)):
            log.warning(
                "compile_once: this rank compiles for cuda:%s%s. Inductor's keys carry the device "
                "index, so only ranks on the same index share compiles. Give every worker its GPU as "
                "cuda:0: launch with `torchrun --virtual-local-rank` (and your other torchrun flags), "
                "or with `coordinator-run`, which sets it.",
                self.index, "" if other_index is None else f" and rank {peer} for cuda:{other_index}",
            )

    def peers(self, world: int, wait_s: float) -> list[int]:
        """The ranks of a job of ``world`` ranks that compile for this rank's index, this
        rank among them, in rank order. Indices not read yet are read, at the first call
        waiting up to ``wait_s`` for ranks that have not written theirs: those count as
        peers, and are read again at the next call (a rank that opens the store late is dealt
        nothing once its index is known to differ)."""
        self._indices[self.rank] = self.index
        deadline = time.monotonic() + (0.0 if self._waited else wait_s)
        self._waited = True
        while True:
            missing = [rank for rank in range(world) if rank not in self._indices]
            if not missing:
                break
            try:
                for rank, value in zip(missing, self.store.get_many([self.key(r) for r in missing]), strict=True):
                    if value is not None:
                        self._indices[rank] = value.decode()
            except StoreError as exc:
                log.debug("compile_once: could not read the ranks' device indices: %s", exc)
                break
            if len(self._indices) >= world or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        unknown = world - sum(rank < world for rank in self._indices)
        if unknown:
            log.debug("compile_once: %d ranks' device indices not known after %.1fs; counted as peers", unknown, wait_s)
        return [rank for rank in range(world) if self._indices.get(rank, self.index) == self.index]
