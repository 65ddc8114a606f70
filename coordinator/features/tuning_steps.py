"""The autotune-hold protocol, the coordinator's side: tuning steps and their claims.

A Triton kernel tunes at its first launch on one thread (config search, then coordinate
descent); ``_compat.triton_tuning_hooks`` runs that as one *tuning step*. Inside a step,
the kernel's autotune lookup claims the key when no rank has published it and none is
tuning it, or waits for the rank that is; the claim ends with the step, published by the
kernel's save or abandoned. Outside a step, autotune keys are only read, so no rank holds
an autotune claim across a collective or while it waits for a graph: a step is a leaf,
and no wait cycle forms through it (``docs/design.md``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.features.kernel_tuning import KernelTuning
from coordinator.protocol.singleflight import Singleflight

#: The kind whose keys are claimed only inside a tuning step.
KIND = "autotune"


class TuningSteps(Feature):
    """The tuning step open on each thread of this process, and the keys it claimed."""

    name = "tuning_steps"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._thread = threading.local()

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.triton_tuning_hooks(KernelTuning(self.step)),) if KIND in routed else ()

    def claims(self) -> list[str] | None:
        """The autotune keys claimed by the step open on this thread (``None``: no step)."""
        return getattr(self._thread, "claims", None)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One kernel's tuning: the claims its lookups make are released when it ends."""
        self._thread.claims = claims = []
        try:
            yield
        finally:
            self._thread.claims = None
            flight = self.context.flight() if claims else None
            if flight is not None:
                for key in claims:
                    flight.abandon(key)  # a no-op for a key the step published

    def lets_wait(self, kind: str) -> bool:
        """Inside a step, a kernel's autotune lookup waits for the rank tuning it."""
        return kind == KIND and self.claims() is not None

    def publishes(self, flight: Singleflight, kind: str, key: str, data: bytes) -> bool:
        """Saved before coordinate descent refines it (or by the descent, whose chosen
        kernel is known when it returns): published then, and the claim stays until then."""
        return kind == KIND and _compat.defer_autotune_save(
            lambda files: self.context.publish(flight, kind, key, data, files))
