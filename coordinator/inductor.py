"""Inductor integration: cache backends that talk to a :class:`Session`.

Each remote cache class in ``torch._inductor.remote_cache`` (FX graph, autotune,
bundled autotune, AOTAutograd, Dynamo PGO) builds its backend from
``backend_override_cls()`` when that is set. We set it, per cache kind, to a small
backend class bound to the session, and turn on the config switches that make
Inductor consult those caches; ``_compat.routed_remote_caches`` restores it all on
exit. Inductor keeps doing what it does on any remote hit: emit bundled Triton
kernels, extend NCCL timeouts; and we keep the FX graphs of remote hits in its local
cache, which it does not do itself (``_compat.fx_graph_lookups``), so a repeated graph
is received once. FX graphs Inductor serves from its local cache are shared
(``coordinator.features.local_hits``), and Triton kernels tuning at their first
launch too (``_compat.triton_tuning_hooks``). Reads of the rank are reported to the
session (``_compat.rank_reads``), which never shares a graph compiled while the rank was
read; and Inductor's switches that run collectives inside a compile are off
(``_compat.collective_switches_off``): only one rank compiles each graph. In max-autotune
each GEMM choice is precompiled where its timing finds it (``_compat.precompile_choices_in_process``).
An FX entry bundles only the Triton kernels its code launches, not every choice a
selection benchmarked (``_compat.bundles_of_final_kernels``). Backward graphs AOTAutograd
defers to the first backward call are reported to the session
(``_compat.deferred_backwards``), whose rank compiles them while it waits for another
rank's graph (``coordinator.features.early_backward``). The graphs DDPOptimizer splits out of a
DDP model, which AOTAutograd's cache bypasses, are saved to it and served from it
(``_compat.cached_split_graphs``), so a restart skips AOTAutograd for them too, and the ranks
compile a share each of every split frame before its chain (``coordinator.features.split_shares``). With
``precompile`` on, whole compiled functions are shared and installed without tracing
(``coordinator.features.precompiled``). On a GPU, Triton's driver utilities are built in the background
as the session starts (``_compat.warm_driver_utilities``), not at the first kernel load.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

from coordinator import _compat
from coordinator.features.kernel_tuning import KernelTuning
from coordinator.features.local_hits import share_local_hit
from coordinator.features.precompiled import PrecompiledFunctions
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


def _available(switch: bool, unsupported: Callable[[], str | None], off_because: str) -> bool:
    """Whether a switched-on feature runs on this torch (``unsupported()`` gives why not)."""
    if not switch:
        return False
    reason = unsupported()
    if reason is not None:
        log.info("compile_once: %s: %s", off_because, reason)
        return False
    return True


def _split_graphs(session: Session) -> contextlib.AbstractContextManager[None]:
    """AOTAutograd's cache for DDPOptimizer's split graphs, where this torch allows it."""
    if not _available(session.config.cache_ddp_graphs, _compat.split_graphs_unsupported,
                      "DDP's split graphs are not served from AOTAutograd's cache"):
        return contextlib.nullcontext()
    return _compat.cached_split_graphs(lambda event, _detail: session.stats.record_split_graph(event))


def _split_shares(session: Session, backends: dict[str, type]) -> contextlib.AbstractContextManager[None]:
    """Each rank compiles a share of every frame DDPOptimizer splits, where the split
    graphs are served from AOTAutograd's cache (the chain loads the shares through it)."""
    config = session.config
    if not (config.concurrent_splits and config.cache_ddp_graphs and "aot_autograd" in backends
            and "fx_graph" in backends and _compat.split_graphs_unsupported() is None):
        return contextlib.nullcontext()
    return _compat.split_frames(session.shares.before_chain)


def _precompiled(session: Session) -> contextlib.AbstractContextManager[None]:
    """Precompiled functions shared through the session, where asked for and this torch allows."""
    if not _available(session.config.precompile, _compat.precompile_unsupported,
                      "precompiled functions are off"):
        return contextlib.nullcontext()
    functions = PrecompiledFunctions(session)
    session.stats.precompiled = functions.counts
    stack = contextlib.ExitStack()
    stack.enter_context(_compat.precompiled_functions(functions.load, functions.recorded, functions.on_install))
    stack.enter_context(_compat.on_compile_end(functions.publish_ready))
    return stack


@contextlib.contextmanager
def route_caches(session: Session) -> Iterator[None]:
    """Send the session's configured Inductor caches through it for the duration."""
    _compat.warm_driver_utilities()  # a restart's first kernel load finds Triton's driver built
    backends = {kind: _backend_class(session, kind) for kind in _compat.routable_kinds(session.config.caches)}
    served = functools.partial(share_local_hit, session) if session.config.share_local_hits else None
    tune = "autotune" in backends
    aot_hits_before = _compat.aot_autograd_cache_hits()
    session.stats.aot_autograd_hits = lambda: _compat.aot_autograd_cache_hits() - aot_hits_before
    with (
        _split_graphs(session),
        _split_shares(session, backends),
        _precompiled(session),
        _compat.collective_switches_off(),
        _compat.routed_remote_caches(backends),
        _compat.on_compile_end(session.compile_ended),
        _compat.rank_reads(session.ranks.rank_read),
        _compat.fx_graph_lookups(served, session.ranks.keep_locally) if "fx_graph" in backends
        else contextlib.nullcontext(),
        _compat.bundles_of_final_kernels() if "fx_graph" in backends else contextlib.nullcontext(),
        _compat.cpu_kernels_resolved(session.kernels.resolved)
        if "fx_graph" in backends and session.config.ship_cpu_kernels else contextlib.nullcontext(),
        _compat.triton_tuning_hooks(KernelTuning(session.tuning.step)) if tune else contextlib.nullcontext(),
        _compat.precompile_choices_in_process() if session.config.compile_choices_once
        else contextlib.nullcontext(),
        _compat.deferred_backwards(session.backward_deferred)
        if (session.config.early_backward or session.config.concurrent_splits) and "fx_graph" in backends
        else contextlib.nullcontext(),
    ):
        yield
