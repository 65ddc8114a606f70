"""Routing Inductor's remote caches to the coordinator, and Inductor's cache paths.

Sets ``backend_override_cls`` on each ``torch._inductor.remote_cache`` class and the
config switches that make Inductor consult them; keeps compile workers' jobs off Inductor's
own Redis backend (``compile_workers``); calls back at the start and at the end of each
compile; names Inductor's cache dir; says whether AOTAutograd entries hold their graphs;
installs Mega-Cache bytes.

Private names: :func:`routed_remote_caches`: ``remote_cache.Remote*Cache.backend_override_cls``,
the ``*_remote_cache`` switches, ``bundle_triton_into_fx_graph_cache``,
``AOTAutogradCache.get_remote_cache``; compile-start and compile-end callbacks
(:func:`on_compile_start`, :func:`on_compile_end`: ``callback_handler``'s
``register_start_callback``/``start_callbacks`` and ``register_end_callback``/``end_callbacks``;
the start callbacks start a session's compile part inside Dynamo's first compile);
cache dirs (:func:`inductor_cache_dir` names the dir as ``cache_dir_utils.cache_dir``/
``default_cache_dir`` do, without importing Inductor); whether AOTAutograd entries hold their
graphs (``autograd_cache.should_bundle_autograd_cache``), and so whether a hit of one saves its
recorded compile time (:func:`hit_saves_compile`: AOTAutograd's ``time_taken_ms`` spans from
its lookup to the end of its compiles); Mega-Cache installs and the FX keys they write
(:func:`load_cache_artifacts`: ``CacheInfo.inductor_artifacts``).

Checked: the compile-start callbacks ran on 2.13.0 and 2.14.1 (CPU tests); the cache dir
compared with torch's own on both CI legs (``tests/test_first_compile.py``); ``time_taken_ms``
read from 2.13.0's ``graph_compile``; ``CacheInfo.inductor_artifacts`` from 2.13.0. GPU tier
on 2.11.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

from coordinator._compat.compile_workers import compile_jobs_without_redis

log = logging.getLogger(__name__)


class WaitRule(str, enum.Enum):
    """When a rank may wait for a key of a cache kind that another rank holds.

    A ``str`` enum: each member equals its value (``WaitRule.ALWAYS == "always"``).
    """

    ALWAYS = "always"
    """Its owner finishes it inside a compile, with no collective."""
    TUNING_STEP = "tuning_step"
    """Only inside a kernel's tuning step (``TuningSteps.step``)."""
    NEVER = "never"
    """It may be finished after a collective: only read."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclasses.dataclass(frozen=True, slots=True)
class CacheKind:
    """One Inductor cache the coordinator can route: everything the code asks of a kind.

    A new kind is one more record in :data:`CACHE_KINDS` (``docs/design.md``, "How to
    extend"); ``tests/test_config.py`` checks each record against the running torch.
    """

    name: str
    """The name in ``Config.caches`` and in store keys."""
    inductor_class: str
    """Its class in ``torch._inductor.remote_cache``, whose ``backend_override_cls`` we set
    ("" for Triton's own caches, which ``coordinator.features.triton_kernels`` routes)."""
    switches: tuple[tuple[str, str], ...]
    """(module, attribute) config switches that make Inductor consult it, on while routed."""
    waits: WaitRule
    """When a rank may wait for a key another rank holds: ``ALWAYS`` (its owner finishes it
    inside a compile, with no collective), ``TUNING_STEP`` (only inside a kernel's tuning
    step, ``TuningSteps.step``) or ``NEVER`` (it may be finished after a collective: only read)."""
    ships_kernels: bool
    """Whether the C++ kernels its compile built travel with its entry (``ship_cpu_kernels``)."""
    triton_only: bool
    """Keys need a Triton backend hash, which a CPU-only process lacks: routed only with a GPU."""
    inductor_extends_timeout: bool
    """Inductor itself extends NCCL timeouts by the compile time saved on its hits; on the
    others the coordinator does."""
    default: bool
    """Routed unless ``Config.caches`` says otherwise."""
    graphs: bool = False
    """Its entries are compiled graphs that Inductor's ``FxGraphCache`` loads: remote hits
    are kept in the local cache, and an entry bundles the kernels its code loads."""
    rank_checked: bool = False
    """Its entries hold generated code that may read the rank: one compiled while the rank
    was read is never shared (``coordinator.features.rank_dependence``)."""
    inside_aot_entries: bool = False
    """Also looked up while AOTAutograd loads an entry of its own; a miss there compiles
    nothing (AOTAutograd compiles the graph afresh and looks it up again), so it neither
    waits nor claims (``in_aot_entry_load``)."""
    saved_by_its_compile: bool = False
    """Its entry is saved before the compile that missed it ends: a compile that ended
    without saving one bypassed the cache or failed (its trace span ends with it)."""
    described_as: str = ""
    """What a claim of it is for, in words (a waiting rank's lines), where the compile
    running says no more (``compiling_now``); "" for its name."""
    leaf: bool = False
    """Its owner computes an entry with no lookup of its own: a rank waits for one even
    while it holds claims (``coordinator.protocol.singleflight``, on cycles)."""


_ALL = (
    CacheKind("fx_graph", "RemoteFxGraphCache", (("torch._inductor.config", "fx_graph_remote_cache"),),
              waits=WaitRule.ALWAYS, ships_kernels=True, triton_only=False, inductor_extends_timeout=True,
              default=True, graphs=True, rank_checked=True, inside_aot_entries=True, saved_by_its_compile=True,
              described_as="an FX graph"),
    CacheKind("autotune", "RemoteAutotuneCache", (("torch._inductor.config", "autotune_remote_cache"),),
              waits=WaitRule.TUNING_STEP, ships_kernels=False, triton_only=True, inductor_extends_timeout=False,
              default=True, described_as="a Triton kernel's autotune result"),
    # Opt-in: switching it on fails the second graph of a job on torch 2.11
    # (``AutotuneCacheBundler.begin_compile`` asserts on a bundler left over from the
    # previous graph), and per-kernel autotune entries already carry the same results.
    CacheKind("bundled_autotune", "RemoteBundledAutotuneCache",
              (("torch._inductor.config", "bundled_autotune_remote_cache"),),
              waits=WaitRule.NEVER, ships_kernels=False, triton_only=True, inductor_extends_timeout=True,
              default=False),
    # Published after the backward compiles, which can follow forward-pass collectives (FSDP).
    CacheKind("aot_autograd", "RemoteAOTAutogradCache", (("torch._functorch.config", "enable_remote_autograd_cache"),),
              waits=WaitRule.NEVER, ships_kernels=False, triton_only=False, inductor_extends_timeout=True,
              default=True),
    # Published at the end of the run.
    CacheKind("pgo", "RemoteDynamoPGOCache", (("torch._dynamo.config", "automatic_dynamic_remote_pgo"),),
              waits=WaitRule.NEVER, ships_kernels=False, triton_only=False, inductor_extends_timeout=False,
              default=True),
)
#: Every Inductor cache kind, by name (what ``Config.caches`` names).
CACHE_KINDS: dict[str, CacheKind] = {kind.name: kind for kind in _ALL}

#: Triton's own caches, outside Inductor (``coordinator.features.triton_kernels``). A kernel's
#: compile runs no lookup while its owner holds it (a leaf); a tuning's owner benchmarks
#: on its own device, waiting only for configs' compiles.
TRITON_KINDS: dict[str, CacheKind] = {kind.name: kind for kind in (
    CacheKind("triton", "", (), waits=WaitRule.ALWAYS, ships_kernels=False, triton_only=False,
              inductor_extends_timeout=False, default=True, described_as="a Triton kernel", leaf=True),
    CacheKind("triton_autotune", "", (), waits=WaitRule.ALWAYS, ships_kernels=False, triton_only=False,
              inductor_extends_timeout=False, default=True, described_as="a Triton kernel's autotune result"),
)}

#: Every kind of entry a session looks up, by name.
KINDS: dict[str, CacheKind] = {**CACHE_KINDS, **TRITON_KINDS}


def ships_kernels(kind: str) -> bool:
    """Whether entries of ``kind`` carry the C++ kernels their compile built: FX-graph
    entries always; AOTAutograd entries while they hold their compiled graphs themselves
    (bundled, as caching precompile makes them: a hit then loads no FX entry, whose
    kernels would have come with it)."""
    if KINDS[kind].ships_kernels:
        return True
    if kind != "aot_autograd":
        return False
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

    return should_bundle_autograd_cache()


def hit_saves_compile(kind: str) -> bool:
    """Whether a hit of ``kind`` saves the compile time its entry records (the ``saved``
    figure): an FX-graph entry's is its graph's Inductor compile. An AOTAutograd entry's
    runs from the start of its lookup to the end of its graphs' compiles, so it holds
    their FX-graph compiles (counted with the FX entries a hit then loads) and any wait
    for them; it counts only while its entries hold their compiled graphs themselves
    (bundled, as caching precompile makes them: a hit then loads no FX entry)."""
    if KINDS[kind].graphs:
        return True
    return kind == "aot_autograd" and ships_kernels(kind)


def load_cache_artifacts(megacache: bytes) -> list[str]:
    """Install Mega-Cache bytes into torch's caches (``torch.compiler.load_cache_artifacts``);
    returns the keys of the FX graphs it wrote into Inductor's local cache (the
    ``CacheInfo``'s ``inductor_artifacts``: the keys ``FxGraphCache._lookup_graph`` is
    given)."""
    import torch

    info = torch.compiler.load_cache_artifacts(megacache)
    return list(getattr(info, "inductor_artifacts", None) or []) if info is not None else []


def routable_kinds(kinds: tuple[str, ...]) -> list[str]:
    """The subset of ``kinds`` that Inductor can use in this process."""
    import torch

    has_gpu = torch.cuda.is_available()
    return [kind for kind in kinds if has_gpu or not CACHE_KINDS[kind].triton_only]


def remote_cache_backend_base() -> type:
    """Inductor's backend base class, ``RemoteCacheBackend``."""
    from torch._inductor.remote_cache import RemoteCacheBackend

    return RemoteCacheBackend


def _import(module: str) -> Any:
    import importlib

    return importlib.import_module(module)


@contextlib.contextmanager
def routed_remote_caches(backends: dict[str, type]) -> Iterator[None]:
    """Route the given Inductor remote caches to ``backends`` (kind -> backend class).

    Sets each class's ``backend_override_cls``, turns on the matching config switches
    and Triton bundling into FX entries; restores every previous value on exit.
    """
    import torch._inductor.remote_cache as remote_cache

    saved: list[tuple[Any, str, Any]] = []

    def set_attr(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    triton_kinds = [kind for kind in backends if CACHE_KINDS[kind].triton_only]
    # The user's own remote autotune cache, on before we route: its workers may use it.
    users_cache = any(getattr(_import(module), attr, None) is True
                      for kind in triton_kinds for module, attr in CACHE_KINDS[kind].switches)
    try:
        for kind, backend_cls in backends.items():
            set_attr(getattr(remote_cache, CACHE_KINDS[kind].inductor_class), "backend_override_cls", backend_cls)
            for module, attr in CACHE_KINDS[kind].switches:
                set_attr(_import(module), attr, True)
        inductor_config = _import("torch._inductor.config")
        set_attr(inductor_config, "bundle_triton_into_fx_graph_cache", True)
        _clear_cached_remote_caches()
        guard = triton_kinds and not users_cache
        with compile_jobs_without_redis() if guard else contextlib.nullcontext():
            yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        _clear_cached_remote_caches()


def _clear_cached_remote_caches() -> None:
    # AOTAutogradCache memoizes its remote cache object; drop it so the override
    # (or its removal) takes effect on the next compile.
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

        AOTAutogradCache.get_remote_cache.cache_clear()
    except (ImportError, AttributeError):
        log.debug("AOTAutogradCache.get_remote_cache is not memoized in this torch")


def on_compile_start(callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` whenever an outermost Dynamo compile starts (a frame, before it is
    traced; a lazy backward), inside the compile; returns what removes it. Dynamo runs its
    start callbacks under a lock it does not re-enter: ``callback`` must not compile."""
    from torch._dynamo.callback import callback_handler

    def adapter(_args: Any = None) -> None:
        callback()

    callback_handler.register_start_callback(adapter)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            callback_handler.start_callbacks.remove(adapter)

    return remove


@contextlib.contextmanager
def on_compile_end(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` whenever an outermost torch.compile compilation ends.

    Dynamo runs its end callbacks after a frame compile and after a lazy backward
    compile, in a ``finally`` block, so this also fires when a compile fails.
    """
    from torch._dynamo.callback import callback_handler

    def adapter(_args: Any = None) -> None:
        callback()

    callback_handler.register_end_callback(adapter)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            callback_handler.end_callbacks.remove(adapter)


def default_cache_dir(user: str) -> str:
    """Inductor's cache dir for ``user`` when ``TORCHINDUCTOR_CACHE_DIR`` is unset, as
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir`` names it (2.11-2.14)."""
    import tempfile

    from torch._environment import is_fbcode

    sanitized = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join("/var/tmp" if is_fbcode() else tempfile.gettempdir(), f"torchinductor_{sanitized}")


def _user() -> str:
    """The user name Inductor's default cache dir is named after (its own fallback included)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        getuid = getattr(os, "getuid", None)
        return f"uid_{getuid()}" if callable(getuid) else "unknown_user"


def inductor_cache_dir() -> str:
    """Inductor's local cache directory, as Inductor's ``cache_dir()`` names it
    (``TORCHINDUCTOR_CACHE_DIR``, else its default), without its side effects: importing
    Inductor (and Dynamo with it, over a second), setting ``TORCHINDUCTOR_CACHE_DIR`` and
    creating the directory. A process that only runs Triton kernels never touches Inductor."""
    directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return os.path.abspath(default_cache_dir(_user()) if directory is None else directory)


def process_compile_seconds() -> float:
    """Seconds this process spent in torch.compile: frame compiles plus lazy backward compiles."""
    from torch._dynamo.utils import compilation_time_metrics

    phases = ("_compile.compile_inner", "backward._backward_impl")
    return float(sum(sum(compilation_time_metrics.get(phase, ())) for phase in phases))
