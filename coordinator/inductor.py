"""Inductor integration: cache backends that talk to a :class:`Session`.

Each remote cache class in ``torch._inductor.remote_cache`` (FX graph, autotune,
bundled autotune, AOTAutograd, Dynamo PGO) builds its backend from
``backend_override_cls()`` when that is set. We set it, per routed cache kind, to a small
backend class bound to the session, and turn on the config switches that make Inductor
consult those caches; ``_compat.routed_remote_caches`` restores it all on exit. Inductor
keeps doing what it does on any remote hit: emit bundled Triton kernels, extend NCCL
timeouts.

Besides the backends, :func:`compile_hooks` gives what every session installs when its
compile part starts (``coordinator.starts``, after the compile features' own hooks):
Inductor's switches that run collectives inside a compile are off
(``_compat.collective_switches_off``: only one rank compiles each graph); the FX graphs of
remote hits are kept in Inductor's local cache, which it does not do itself
(``_compat.fx_graph_lookups``), so a repeated graph is received once; an FX entry bundles
only the Triton kernels its code launches (``_compat.bundles_of_final_kernels``) and, on
CPU, the C++ kernels its code loads (``_compat.cpu_kernels_resolved``); the end of each
compile and each backward graph AOTAutograd defers are reported to the session. On a GPU,
Triton's driver utilities are built in the background then
(``_compat.warm_driver_utilities``), not at the first kernel load. Every Triton compile
job Inductor's compile workers run while autotune caches are routed is kept off Inductor's
Redis, whenever the pool started (``_compat.compile_jobs_without_redis``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from coordinator import _compat
from coordinator.features import Feature
from coordinator.session import Session

log = logging.getLogger(__name__)


def _backend_class(session: Session, kind: str) -> type:
    base = _compat.remote_cache_backend_base()

    def __init__(self) -> None:
        base.__init__(self)

    def _get(self, key: str) -> bytes | None:
        try:
            return session.get(kind, key)
        except _compat.SkipCompile:  # ends an early compile (``coordinator.features.early_backward``)
            raise
        except Exception:  # never let the coordinator fail a compile
            log.warning("compile_once: %s lookup failed; compiling locally", kind, exc_info=True)
            return None

    def _put(self, key: str, data: bytes) -> None:
        try:
            session.put(kind, key, data)
        except Exception:
            log.warning("compile_once: publishing %s entry failed", kind, exc_info=True)

    name = "Coordinator" + "".join(part.title() for part in kind.split("_")) + "Backend"
    return type(name, (base,), {"__init__": __init__, "_get": _get, "_put": _put})


def _overridden(session: Session, method: str) -> bool:
    """Whether a feature on in ``session`` overrides ``Feature.<method>``."""
    return any(getattr(type(feature), method) is not getattr(Feature, method) for feature in session.features)


def compile_hooks(session: Session) -> list[contextlib.AbstractContextManager]:
    """What every session installs when its compile part starts, whatever its features
    (theirs come first: ``coordinator.starts``)."""
    _compat.warm_driver_utilities()  # a restart's first kernel load finds Triton's driver built
    backends = {kind: _backend_class(session, kind) for kind in sorted(session.routed)}
    graphs = any(_compat.CACHE_KINDS[kind].graphs for kind in backends)
    served = None
    if _overridden(session, "served_locally"):
        def served(*args, **kwargs) -> None:
            for feature in session.features:
                feature.served_locally(*args, **kwargs)

    def keep_locally(local_key: str) -> bool:
        return all(feature.keeps_locally(local_key) for feature in session.features)

    hooks = [
        _aot_autograd_hits_counted(session),
        _compat.collective_switches_off(),
        _compat.routed_remote_caches(backends),
        _compat.on_compile_end(session.compile_ended),
    ]
    if graphs:
        hooks += [_compat.fx_graph_lookups(served, keep_locally), _compat.bundles_of_final_kernels()]
        if session.config.ship_cpu_kernels:
            hooks.append(_compat.cpu_kernels_resolved(session.kernels.resolved))
        if _overridden(session, "backward_deferred"):
            hooks.append(_compat.deferred_backwards(session.backward_deferred))
    return hooks


@contextlib.contextmanager
def _aot_autograd_hits_counted(session: Session) -> Iterator[None]:
    """The session's count of AOTAutograd's cache hits: those from now on."""
    before = _compat.aot_autograd_cache_hits()
    session.stats.aot_autograd_hits = lambda: _compat.aot_autograd_cache_hits() - before
    yield
