"""Every use of a torch-private API in the coordinator lives in this module.

Inductor exposes what we need only through private names: the remote-cache classes and
their ``backend_override_cls`` hook, config switches, the default process group's store,
the ephemeral NCCL timeout extension, the compile-end callback, the FX-graph cache's
lookup and local writes, and the Triton autotuner's tuning steps. Keeping them here
means one file to check when torch moves.

Torch versions, where each ran:

=========  ===========  ==========================================================
torch      where        notes
=========  ===========  ==========================================================
2.13.0     CPU (x86)    dev and CI machines; the full test suite; every hook below
                        read from its source
2.14.1     CPU (x86)    a CUDA build run on the CPU; CI's second leg, the full suite
2.11.0     H200, H100   device machines; the GPU tier (``tests/gpu``) and the GPU
                        benchmarks of ``benchmarks/RESULTS.md``
=========  ===========  ==========================================================

Hooks and the private names they use, with where they were checked beyond 2.13.0 (CPU):

* Routing caches (``routed_remote_caches``): ``remote_cache.Remote*Cache.backend_override_cls``,
  the ``*_remote_cache`` config switches, ``bundle_triton_into_fx_graph_cache``,
  ``AOTAutogradCache.get_remote_cache``. GPU tier on 2.11.0.
* Compile workers off Redis (``compile_workers_without_redis``): ``TORCHINDUCTOR_REDIS_URL``;
  Inductor's ``create_cache`` swallows the backend's construction error. 2.13.0 only.
* FX-graph lookups (``fx_graph_lookups``): ``FxGraphCache._lookup_graph``,
  ``_write_to_local_cache``, ``_get_tmp_dir_for_key``, ``codecache._worker_compile_cpp``,
  ``RedisRemoteCache._get_key`` and the FX remote value format of ``FxGraphCache._save_graph``
  (``{"data": <base64>, ...}``). 2.11.0 does not keep remote hits in its local cache itself;
  keeping them ran in the GPU tier on 2.11.0.
* Triton tuning steps (``triton_tuning_hooks``, ``route_autotune_cache``,
  ``share_config_kept_from_cache``): ``CachingAutotuner.autotune_to_one_config``,
  ``coordinate_descent_tuning``, ``recheck_autotune_cache``, ``restore_after_unpickle``,
  ``precompile``, ``save_cache_hook``, ``configs``/``compile_results``, ``filename``,
  ``inductor_meta``, ``triton_meta["device"]``; ``AutotuneCache._prepare_key``,
  ``_setup_remote_autotune_cache``, ``remote_cache``, ``configs_hash``, ``_read``,
  ``read_best``; ``hash_configs``, ``check_autotune_cache``. Read from 2.11.0's source too;
  the ``read_best``/``recheck_autotune_cache`` backports (pytorch#172819) apply before 2.12.
  GPU tier on 2.11.0 (all four cases). 2.14 adds ``CachingAutotuner._could_rblock_scale``,
  read by ``recheck_autotune_cache``.
* Guards (``rank_reads``, ``collective_switches_off``): ``torch.distributed.get_rank``,
  ``ProcessGroup.rank``, the rank reads of ``fx_passes/bucketing.py``, ``decomp_comms``,
  ``ddp_fusion``, ``select_algorithm`` and ``_logging/_internal.py`` (torch's log formatter
  reads the rank for each record: found by the GPU tier's max-autotune case on 2.11.0), and the
  switches ``distributed_max_autotune_gemm``, ``distributed_runtime_autotune``,
  ``aten_distributed_optimizations.spmd_check``.
* NCCL timeouts (``extend_nccl_timeouts``, ``has_nccl_process_group``), the default store
  (``default_c10d_store``) and compile-end callbacks (``on_compile_end``): 2.11.0 on GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

#: coordinator cache kind -> class name in ``torch._inductor.remote_cache``.
REMOTE_CACHE_CLASSES = {
    "fx_graph": "RemoteFxGraphCache",
    "autotune": "RemoteAutotuneCache",
    "bundled_autotune": "RemoteBundledAutotuneCache",
    "aot_autograd": "RemoteAOTAutogradCache",
    "pgo": "RemoteDynamoPGOCache",
}

#: coordinator cache kind -> (module, attribute) switched on while routed.
_CONFIG_SWITCHES = {
    "fx_graph": [("torch._inductor.config", "fx_graph_remote_cache")],
    "autotune": [("torch._inductor.config", "autotune_remote_cache")],
    "bundled_autotune": [("torch._inductor.config", "bundled_autotune_remote_cache")],
    "aot_autograd": [("torch._functorch.config", "enable_remote_autograd_cache")],
    "pgo": [("torch._dynamo.config", "automatic_dynamic_remote_pgo")],
}

#: Caches of Triton kernels: their keys need a Triton backend hash, which a CPU-only
#: process lacks (turning them on there trips an assertion in Inductor).
TRITON_ONLY_KINDS = frozenset({"autotune", "bundled_autotune"})

#: Caches on whose hits Inductor itself extends NCCL timeouts by the compile time saved
#: (``add_ephemeral_timeout_increase_for_distributed``); on the others we do it.
INDUCTOR_EXTENDS_TIMEOUT = frozenset({"fx_graph", "aot_autograd", "bundled_autotune"})


def routable_kinds(kinds: tuple[str, ...]) -> list[str]:
    """The subset of ``kinds`` that Inductor can use in this process."""
    import torch

    has_gpu = torch.cuda.is_available()
    return [kind for kind in kinds if has_gpu or kind not in TRITON_ONLY_KINDS]


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

    try:
        for kind, backend_cls in backends.items():
            set_attr(getattr(remote_cache, REMOTE_CACHE_CLASSES[kind]), "backend_override_cls", backend_cls)
            for module, attr in _CONFIG_SWITCHES[kind]:
                set_attr(_import(module), attr, True)
        inductor_config = _import("torch._inductor.config")
        set_attr(inductor_config, "bundle_triton_into_fx_graph_cache", True)
        _clear_cached_remote_caches()
        with compile_workers_without_redis() if TRITON_ONLY_KINDS & set(backends) else contextlib.nullcontext():
            yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        _clear_cached_remote_caches()


#: Inductor's Redis URL as compile workers see it while we route autotune caches.
NO_REDIS_URL = "coordinator-no-remote-cache-in-compile-workers://"
_REDIS_VARIABLES = ("TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")


@contextlib.contextmanager
def compile_workers_without_redis() -> Iterator[None]:
    """Keep Inductor's compile workers off Redis while autotune caches are routed.

    Routing switches ``autotune_remote_cache`` on, and Inductor bakes that switch into
    every Triton kernel's ``inductor_meta``. Its compile workers (subprocesses, started
    with this process's environment) build their own autotune caches from it, without
    our ``backend_override_cls``, so they fall back to Inductor's Redis backend. With
    redis-py installed and no server on localhost:6379, each lookup then spends about
    4 s in redis-py's connection retries. An invalid ``TORCHINDUCTOR_REDIS_URL`` makes
    that backend fail at once, at construction (``create_cache`` logs it to the worker's
    log file and goes on without a remote cache). Left alone when the user configured
    Inductor's Redis, and only for workers started while this is active.
    """
    if any(name in os.environ for name in _REDIS_VARIABLES):
        yield
        return
    os.environ["TORCHINDUCTOR_REDIS_URL"] = NO_REDIS_URL
    try:
        yield
    finally:
        if os.environ.get("TORCHINDUCTOR_REDIS_URL") == NO_REDIS_URL:
            del os.environ["TORCHINDUCTOR_REDIS_URL"]


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
#: a process group exists), the profiler, and the coordinator.
RANK_READS_IGNORED_MODULES = ("torch.distributed", "torch._logging", "torch.profiler", "torch.utils.debug_log",
                              "logging", "coordinator")
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


def _clear_cached_remote_caches() -> None:
    # AOTAutogradCache memoizes its remote cache object; drop it so the override
    # (or its removal) takes effect on the next compile.
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

        AOTAutogradCache.get_remote_cache.cache_clear()
    except (ImportError, AttributeError):
        log.debug("AOTAutogradCache.get_remote_cache is not memoized in this torch")


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


class _RecordingRemoteCache:
    """Inductor's remote cache, remembering what its ``get`` returned."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.value: Any = None

    def get(self, key: str) -> Any:
        self.value = self._cache.get(key)
        return self.value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def _keep_locally(fx_cache: Any, key: str, remote_value: Any) -> None:
    """Write an FX entry that came from the remote cache into the local one, as
    ``InductorCacheArtifact.populate_cache`` (Mega-Cache) does: Inductor's lookup reads
    local entries first, so the graph's next lookup (a transformer's next identical
    layer, a recompile) loads from disk instead of asking the remote cache again."""
    import base64

    try:
        content = base64.b64decode(remote_value["data"])
        fx_cache._write_to_local_cache(key, content)
    except Exception as exc:  # the next lookup then asks the remote cache again
        log.debug("could not keep FX graph %s in the local cache: %s", key, exc)


@contextlib.contextmanager
def fx_graph_lookups(
    served: Callable[[str, Callable[[], bytes | None], list[str]], None] | None = None,
    keep_locally: Callable[[str], bool] | None = None,
) -> Iterator[None]:
    """Keep FX graphs from remote hits in Inductor's local cache, call
    ``served(key, remote_value, kernel_files)`` (if given) after each FX-graph cache hit,
    and write a graph Inductor saves to its local cache only if ``keep_locally(key)``
    (if given; ``key`` is Inductor's own key, ``FxGraphCache._write_to_local_cache``).

    Wraps ``FxGraphCache._lookup_graph``, through which both ``FxGraphCache.load`` and
    AOTAutograd cache hits load their graphs. Inductor (2.11, 2.13) does not write an
    entry it got from the remote cache to its local cache, so every lookup of a repeated
    graph would go to the remote cache, and emit the graph's Triton bundle, again.
    ``key`` is the key the remote cache's backend sees for the graph. ``remote_value()`` returns the entry as
    Inductor's FX remote cache would store it, built from this process's local cache dir
    when that holds exactly one entry for ``key`` (Inductor writes the same pickled bytes
    to both), else ``None``. ``kernel_files`` are the files Inductor's C++ builders made
    or found for the graph's kernels while it loaded (``_worker_compile_cpp`` targets:
    ``.o`` objects and ``.so`` libraries; none on GPU, where Triton kernels are inside
    the entry).
    """
    from torch._inductor import codecache

    fx_cache = codecache.FxGraphCache
    original_lookup = fx_cache.__dict__["_lookup_graph"]
    original_write = fx_cache.__dict__["_write_to_local_cache"]
    original_worker = codecache._worker_compile_cpp
    recording = threading.local()

    def worker_compile_cpp(*args: Any, **kwargs: Any) -> None:
        # (lock_path, builders) on 2.13; (lock_path, builder, ...) in some earlier versions.
        files = getattr(recording, "files", None)
        if files is not None:
            for arg in args[1:]:
                for builder in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if hasattr(builder, "get_target_file_path"):
                        files.append(builder.get_target_file_path())
        return original_worker(*args, **kwargs)

    def lookup_graph(key: str, example_inputs: Any, local: bool, remote_cache: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(recording, "files", None)
        recording.files = files = []
        remote = _RecordingRemoteCache(remote_cache) if remote_cache else remote_cache
        try:
            result = original_lookup.__func__(key, example_inputs, local, remote, *args, **kwargs)
        finally:
            recording.files = outer
        graph = result[0] if isinstance(result, tuple) else result  # (graph, cache info) since 2.6
        # Local entries are read first: a remote value means the local ones missed.
        if graph is not None and local and remote and remote.value is not None:
            _keep_locally(fx_cache, key, remote.value)
        if served is None:
            return result
        # The key our backend sees: Inductor's Redis-style remote caches format it
        # (``pt2:fx-graph-v1::<key>:c1``). Without a remote cache there is no backend.
        get_key = getattr(remote_cache, "_get_key", None)
        if graph is not None and get_key is not None:

            def remote_value() -> bytes | None:
                entry = _local_fx_entry(fx_cache, key)
                return None if entry is None else fx_graph_remote_value(entry, getattr(graph, "_time_taken_ns", None))

            try:
                served(get_key(key), remote_value, files)
            except Exception:  # the coordinator never fails a cache hit
                log.warning("compile_once: handling the FX cache hit for %s failed", key, exc_info=True)
        return result

    def write_to_local_cache(key: str, content: bytes) -> None:
        if keep_locally is None or keep_locally(key):
            original_write.__func__(key, content)
        else:
            log.debug("not keeping FX graph %s in the local cache", key)

    fx_cache._lookup_graph = staticmethod(lookup_graph)
    fx_cache._write_to_local_cache = staticmethod(write_to_local_cache)
    codecache._worker_compile_cpp = worker_compile_cpp
    try:
        yield
    finally:
        fx_cache._lookup_graph = original_lookup
        fx_cache._write_to_local_cache = original_write
        codecache._worker_compile_cpp = original_worker


def _local_fx_entry(fx_cache: Any, key: str) -> bytes | None:
    subdir = fx_cache._get_tmp_dir_for_key(key)
    try:
        entries = os.listdir(subdir)
    except OSError:
        return None
    if len(entries) != 1:  # several guarded candidates: which one hit is not known here
        return None
    with open(os.path.join(subdir, entries[0]), "rb") as f:
        return f.read()


def fx_graph_remote_value(entry: bytes, time_taken_ns: int | None) -> bytes:
    """The bytes Inductor's FX-graph remote cache stores for a pickled local ``entry``
    (``FxGraphCache._save_graph`` + ``RemoteCacheJsonSerde``)."""
    import base64
    import json

    data = {"data": base64.b64encode(entry).decode("ascii"), "time_taken_ms": int((time_taken_ns or 0) // 1e6)}
    return bytes(json.dumps(data), "ascii")


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


def _torch_before(major: int, minor: int) -> bool:
    import torch

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return version < (major, minor)


#: The tuning step open on this thread: the kernel (``kernel``), the session's step
#: context (``exit``), the stage (``stage``: "search" while a save must wait for the
#: descent, "descent") and a held save (``pending``).
_tuning = threading.local()


def defer_autotune_save(publish: Callable[[dict[str, bytes]], None]) -> bool:
    """Hold an autotune entry Inductor is saving until its kernel's coordinate descent ends.

    Triton kernels tuned at their first launch save a best config after the config
    search and, when coordinate descent is on for the kernel, again when the descent
    has refined it. Sharing the first would give other ranks a different config than
    this rank runs (or, on torch < 2.12, have them run the descent themselves). Inside
    :func:`triton_tuning_hooks`, while a kernel whose ``inductor_meta`` turns coordinate
    descent on searches configs or descends, ``publish`` is kept (a later save of the
    same kernel replaces it) and called when the descent returns, with the Triton cache
    entry of the config it chose (compiled during the descent, so not in the FX entry).

    Returns:
        True if held; False if the caller should publish now.
    """
    if getattr(_tuning, "stage", None) is None:
        return False
    _tuning.pending = publish
    return True


def triton_cache_dir(device: int | None = None) -> str:
    """Triton's cache dir as Inductor sets it up for ``device`` (``TRITON_CACHE_DIR`` wins;
    default: the current CUDA device)."""
    if device is None:
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir as inductor_triton_cache_dir
    except ImportError:  # before cache_dir_utils existed
        from torch._inductor.runtime.runtime_utils import triton_cache_dir as inductor_triton_cache_dir
    return inductor_triton_cache_dir(device)


def _open_step(kernel: Any, step: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    exit_stack = contextlib.ExitStack()
    exit_stack.enter_context(step())
    _tuning.kernel, _tuning.exit, _tuning.stage, _tuning.pending = kernel, exit_stack, None, None


def _close_step() -> None:
    exit_stack = getattr(_tuning, "exit", None)
    _tuning.kernel = _tuning.exit = _tuning.stage = _tuning.pending = None
    if exit_stack is not None:
        exit_stack.close()


def _published_config(kernel: Any) -> Any:
    """The config another rank tuned for ``kernel``, looked up inside its tuning step:
    a miss claims the key, and while another rank tunes the kernel this waits for it."""
    cache = kernel_autotune_cache(kernel)
    if cache is None or cache.remote_cache is None or not getattr(kernel, "launchers", None):
        return None
    remote, key = cache.remote_cache
    best = remote.get(key)
    if not isinstance(best, dict):
        return None
    from torch._inductor.runtime.autotune_cache import _load_cached_autotuning

    return _load_cached_autotuning(dict(best), cache.configs_hash, [launcher.config for launcher in kernel.launchers],
                                   kernel.inductor_meta)


def adopt_config(kernel: Any, config: Any) -> Any:
    """Make ``kernel`` launch with ``config`` (tuned by another rank) without tuning.

    Picks the launcher compiled for ``config`` or, for a config coordinate descent found
    (not among the kernel's own), compiles it as the descent does; Triton finds its
    binary in its cache, where the autotune entry brought it. Keeps the pick in this
    rank's local autotune cache. Returns the launcher, or ``None`` if it cannot (the
    kernel then tunes as it would have).
    """
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

    try:
        wanted = triton_config_to_hashable(config)
        chosen = next((launcher for launcher in kernel.launchers
                       if triton_config_to_hashable(launcher.config) == wanted), None)
        if chosen is None:
            if getattr(kernel.fn, "fn", None) is None:  # compiled in a worker: reload the source
                kernel.fn = kernel._reload_kernel().fn
            with kernel.lock:
                chosen = kernel._precompile_config(config).make_launcher()
        if getattr(config, "found_by_coordesc", False):
            chosen.config.found_by_coordesc = True
        if hasattr(kernel, "_release_static_launchers_except"):  # 2.13: closes the launchers it drops
            kernel._release_static_launchers_except(chosen)
        kernel.launchers = [chosen]
        if hasattr(kernel, "_prune_compile_results_to_launcher") and chosen.config in [
                result.config for result in kernel.compile_results or []]:
            kernel._prune_compile_results_to_launcher(chosen)
        cache = kernel_autotune_cache(kernel)
        if cache is not None and cache.local_cache is not None:
            local, key = cache.local_cache
            local.put(key, {**chosen.config.kwargs, "num_warps": chosen.config.num_warps,
                            "num_stages": chosen.config.num_stages, "configs_hash": cache.configs_hash,
                            "found_by_coordesc": bool(getattr(chosen.config, "found_by_coordesc", False))})
        return chosen
    except Exception:  # the coordinator never fails a kernel launch: tune instead
        log.warning("compile_once: could not use the config another rank tuned for %s; tuning it here",
                    kernel.inductor_meta.get("kernel_name"), exc_info=True)
        return None


@contextlib.contextmanager
def triton_tuning_hooks(step: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """Run each Triton kernel's first-launch tuning as a tuning step of the session, for the duration.

    A kernel with several configs searches them (``CachingAutotuner.autotune_to_one_config``)
    and, where coordinate descent is on, then descends from the winner
    (``coordinate_descent_tuning``); both run in ``CachingAutotuner.run`` at the first
    launch. The step (``step()``, :meth:`Session.tuning_step`) opens before the search (or
    before the descent, for a kernel with one config) and closes after the last of them.
    At its start the kernel's autotune key is looked up: a config another rank published
    is adopted (:func:`adopt_config`) instead of tuning; while another rank tunes the
    kernel, this rank waits for it; otherwise it claims the key, tunes, and its save
    publishes (held until the descent ends: :func:`defer_autotune_save`). Every rank that
    runs the kernel thus runs the same config, tuned once.

    Also wraps ``restore_after_unpickle`` to route the autotune cache of kernels compiled in
    compile workers, and of static autotuners from FX entries as they are rechecked
    (:func:`route_autotune_cache`), and shares the config of a worker kernel that found it in
    this rank's own cache under the key its loaders look up (:func:`share_config_kept_from_cache`).
    On torch < 2.12 also fixes how Inductor restores a config that coordinate descent chose
    (pytorch/pytorch#172819): :func:`_read_best_fixed` and :func:`_recheck_autotune_cache_fixed`.
    """
    from torch._inductor.runtime import triton_heuristics as th

    autotuner = th.CachingAutotuner
    originals = {name: autotuner.__dict__[name] for name in
                 ("autotune_to_one_config", "coordinate_descent_tuning", "recheck_autotune_cache")}
    has_restore = "restore_after_unpickle" in autotuner.__dict__
    if has_restore:
        originals["restore_after_unpickle"] = autotuner.__dict__["restore_after_unpickle"]

    def restore_after_unpickle(self: Any, old_values: Any) -> None:
        originals["restore_after_unpickle"](self, old_values)
        if old_values is None:  # a kernel compiled in a compile worker, arriving in this process
            route_autotune_cache(self)
            share_config_kept_from_cache(self)

    def descends(self: Any) -> bool:  # run() calls coordinate_descent_tuning next
        launchers = getattr(self, "launchers", None) or [None]
        return bool(self.inductor_meta.get("coordinate_descent_tuning")) and not getattr(
            getattr(launchers[0], "config", None), "found_by_coordesc", False)

    def autotune_to_one_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        _open_step(self, step)
        try:
            config = _published_config(self)
            if config is not None and adopt_config(self, config) is not None:
                log.debug("adopted the published config of %s: %s", self.inductor_meta.get("kernel_name"), config)
                result = None
            else:
                if self.inductor_meta.get("coordinate_descent_tuning"):
                    _tuning.stage = "search"  # the descent refines it next: hold the save
                result = originals["autotune_to_one_config"](self, *args, **kwargs)
        except BaseException:
            _close_step()
            raise
        if descends(self):  # the step goes on into the descent, which publishes
            _tuning.stage = None
        else:
            held, _tuning.stage = _tuning.pending, None
            try:
                if held is not None:  # published before the step releases its claim
                    held({})
            finally:
                _close_step()
        return result

    def coordinate_descent_tuning(self: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_coordinator_descended", False):  # declined before: run() asks at every launch
            return originals["coordinate_descent_tuning"](self, launcher, *args, **kwargs)
        if getattr(_tuning, "kernel", None) is not self:  # one config: no search opened the step
            _open_step(self, step)
            config = _published_config(self)
            if config is not None and getattr(config, "found_by_coordesc", False):
                adopted = adopt_config(self, config)
                if adopted is not None:
                    self._coordinator_descended = True
                    _close_step()
                    return adopted
        held_from_search, _tuning.stage, _tuning.pending = getattr(_tuning, "pending", None), "descent", None
        try:
            winner = originals["coordinate_descent_tuning"](self, launcher, *args, **kwargs)
            descended = _tuning.pending
            _tuning.stage = _tuning.pending = None
            log.debug("coordinate descent for %s: %s -> %s; saved %s, held from the search %s",
                      self.inductor_meta.get("kernel_name"), getattr(launcher, "config", None),
                      getattr(winner, "config", None), descended is not None, held_from_search is not None)
            self._coordinator_descended = True
            try:  # the coordinator never fails a kernel launch
                if descended is not None:
                    files: dict[str, bytes] = {}
                    kernel_hash = getattr(winner, "cache_hash", None)
                    if kernel_hash:
                        from coordinator.artifacts import read_triton_kernel

                        device = self.triton_meta.get("device", 0)
                        files = read_triton_kernel(os.path.join(triton_cache_dir(device), kernel_hash))
                    descended(files)
                elif held_from_search is not None:  # this kernel does not descend: the search's result stands
                    held_from_search({})
            except Exception:
                log.warning("compile_once: publishing the tuned config of %s failed",
                            self.inductor_meta.get("kernel_name"), exc_info=True)
            return winner
        finally:
            _close_step()

    backport = _torch_before(2, 12)  # pytorch#172819 is fixed from 2.12
    recheck = _recheck_autotune_cache_fixed if backport else originals["recheck_autotune_cache"]

    def recheck_autotune_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A static autotuner from an FX entry names the kernel file of the process that
        # compiled it; Inductor derives the kernel's local autotune file from that path.
        # On one host with per-rank cache dirs, this rank would read the compiling
        # rank's file, mid-tuning (before coordinate descent). Point it at our own copy.
        if getattr(self, "filename", None):
            self.filename = os.path.join(inductor_cache_dir(), *os.path.normpath(self.filename).split(os.sep)[-2:])
        # The recheck looks the config up through a cache of its own, but the kernel saves
        # through the one pickled into the FX entry: route that one too, or this rank's
        # tuned config would never reach the store.
        route_autotune_cache(self)
        return recheck(self, *args, **kwargs)

    from torch._inductor.runtime.autotune_cache import AutotuneCache

    original_read_best = AutotuneCache.__dict__["read_best"]
    autotuner.autotune_to_one_config = autotune_to_one_config
    autotuner.coordinate_descent_tuning = coordinate_descent_tuning
    autotuner.recheck_autotune_cache = recheck_autotune_cache
    if has_restore:
        autotuner.restore_after_unpickle = restore_after_unpickle
    if backport:
        AutotuneCache.read_best = _read_best_fixed
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(autotuner, name, original)
        AutotuneCache.read_best = original_read_best
        _close_step()


def kernel_autotune_cache(autotuner: Any) -> Any:
    """The ``AutotuneCache`` a kernel saves its tuned config through, or ``None``.

    ``CachingAutotuner`` keeps no reference to its cache but the bound method
    ``save_cache_hook`` (``cached_autotune`` passes ``autotune_cache.save``).
    """
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    cache = getattr(getattr(autotuner, "save_cache_hook", None), "__self__", None)
    return cache if isinstance(cache, AutotuneCache) else None


def route_autotune_cache(autotuner: Any) -> None:
    """Send the tuned config of a kernel built outside this process through the coordinator.

    Inductor compiles most Triton kernels in its compile workers, which build the kernel's
    ``AutotuneCache`` there: with no coordinator backend installed (and Redis kept out),
    its remote cache is ``None``. Back in this process the kernel tunes at its first
    launch and would save its best config to this rank's local cache only, and other ranks
    loading the kernel from the FX entry would tune it again. The same holds for a static
    autotuner unpickled from an FX entry that such a kernel went into. Here the cache gets
    the coordinator's remote cache, as ``AutotuneCache.create`` would have built it in this
    process; the kernel's tuning step (:func:`triton_tuning_hooks`) looks its key up
    through it. Nothing here fails a compile.
    """
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    cache, filename = kernel_autotune_cache(autotuner), getattr(autotuner, "filename", None)
    if cache is None or cache.remote_cache is not None or not filename:
        return
    prepare_key = getattr(AutotuneCache, "_prepare_key", None)
    if prepare_key is None:  # an older AutotuneCache (key = filename): not checked, left alone
        return
    try:
        cache._setup_remote_autotune_cache(autotuner.inductor_meta, prepare_key(filename))
        log.debug("routed the autotune cache of %s", autotuner.inductor_meta.get("kernel_name"))
    except Exception:
        log.warning("compile_once: could not route the autotune cache of %s",
                    getattr(autotuner, "inductor_meta", {}).get("kernel_name"), exc_info=True)


def share_config_kept_from_cache(autotuner: Any) -> None:
    """Share the config of a worker-compiled kernel that found it in this rank's own cache.

    With coordinate descent on, a compile worker that finds a kernel's best config in this
    rank's local autotune cache (the rank tuned the same kernel source in an earlier graph,
    as a transformer's layers repeat) keeps that config alone, and so does the FX entry the
    kernel goes into. A rank loading the entry looks the config up under the hash of that
    one-config list (``recheck_autotune_cache``), not the list's the config was published
    under: it missed, and descended again (10 kernels and 81 Triton compiles for the last
    graph of a 12-layer follower on the GPU host). Here the cached entry is published under
    that key too. On torch < 2.12 the worker's ``read_best`` also dropped
    ``found_by_coordesc`` from a config equal to one of the kernel's own (see
    :func:`_read_best_fixed`), and this rank descended again at the first launch (11
    kernels on that leader): the flag is put back. Nothing here fails a compile.

    The case is told by the kernel's one compiled config (what a loader's recheck hashes)
    hashing differently from the list its cache was made for, and equalling the entry in
    this rank's local file. A first version that asked ``autotune_cache_info`` for a hit and
    read ``configs`` never fired on torch 2.11 (``benchmarks/gpu/logs-2026-11-22-i/gpu1-large-coordesc-n2*``);
    this one does (``benchmarks/gpu/logs-2026-11-23/gpu1-large-coordesc-n2*``).
    """
    try:
        meta = autotuner.inductor_meta
        # What a loader's recheck hashes: the configs the kernel was compiled for.
        compiled = [result.config for result in getattr(autotuner, "compile_results", None) or []]
        kept = compiled or list(getattr(autotuner, "configs", None) or [])
        cache = kernel_autotune_cache(autotuner)
        if cache is None or len(kept) != 1 or not meta.get("coordinate_descent_tuning"):
            return
        from torch._inductor.runtime.autotune_cache import AutotuneCache
        from torch._inductor.runtime.triton_heuristics import hash_configs

        kept_hash = hash_configs(kept)
        if kept_hash == cache.configs_hash:  # the kernel's own list: no config was found in a cache
            return
        # The worker kept the config it found in this rank's local file; read that file (a
        # local file exists, so this never asks, or claims in, the store).
        cached = cache._read()

        def is_cached(config: Any) -> bool:
            fields = [*config.kwargs.items(), ("num_warps", config.num_warps), ("num_stages", config.num_stages)]
            return all(cached.get(name) == value for name, value in fields)

        if not cached or not is_cached(kept[0]):
            return
        if cached.get("found_by_coordesc"):
            for config in [*kept, *(getattr(autotuner, "configs", None) or [])]:
                if is_cached(config):
                    config.found_by_coordesc = True
        alias = AutotuneCache(kept_hash)
        alias._setup_remote_autotune_cache(meta, AutotuneCache._prepare_key(autotuner.filename))
        if alias.remote_cache is None:
            return
        remote, key = alias.remote_cache
        held = getattr(_tuning, "stage", None), getattr(_tuning, "pending", None)
        _tuning.stage = None  # published now, never held as a tuning step's result
        try:
            remote.put(key, {**cached, "configs_hash": kept_hash})
        finally:
            _tuning.stage, _tuning.pending = held
        log.debug("shared the cached config of %s for its one-config list too", meta.get("kernel_name"))
    except Exception:
        log.warning("compile_once: could not share the cached config of %s",
                    getattr(autotuner, "inductor_meta", {}).get("kernel_name"), exc_info=True)


def _read_best_fixed(self: Any, inductor_meta: dict[str, Any], configs: list[Any]) -> Any:
    """``AutotuneCache.read_best`` (2.11's body) that keeps ``found_by_coordesc``.

    Before 2.12, a cached config that coordinate descent chose, when it equals one of
    the kernel's own configs, came back as that config without the flag, so the kernel
    ran coordinate descent again (seen on 2.11 for 3 of 25 kernels in the GPU tier).
    """
    from torch._inductor.runtime import autotune_cache

    best = self._read()
    log.debug("read_best %s: %s", inductor_meta.get("kernel_name"), best)
    if not best:
        return None
    by_coordesc = bool(inductor_meta.get("coordinate_descent_tuning") and best.get("found_by_coordesc"))
    config = autotune_cache._load_cached_autotuning(best, self.configs_hash, configs, inductor_meta)
    if config is not None and by_coordesc:
        config.found_by_coordesc = True
    return config


def _recheck_autotune_cache_fixed(self: Any, reload_kernel_from_src: Callable[[], Any]) -> None:
    """``CachingAutotuner.recheck_autotune_cache`` as torch 2.12 fixed it (pytorch#172819).

    Before 2.12, a kernel restored from an FX entry (static CUDA launcher) whose cached
    config came from coordinate descent forgot that: the cache check was skipped for
    kernels with one config, and ``found_by_coordesc`` was not carried over to the
    matching compile result. The kernel then ran coordinate descent again on every
    rank that loaded it. Same body as 2.11's, with those two fixes.
    """
    from torch._inductor.runtime import triton_heuristics as th

    assert self.is_statically_launchable()
    configs = [result.config for result in self.compile_results]
    cached_configs, _, autotune_cache_info = th.check_autotune_cache(configs, self.filename, self.inductor_meta)
    self.autotune_cache_info = autotune_cache_info
    if len(cached_configs) != 1:  # 2.11: also required len(configs) > 1
        return
    best_config = cached_configs[0]
    found_by_coordesc = getattr(best_config, "found_by_coordesc", False)
    best_config_hash = th.triton_config_to_hashable(best_config)
    for compile_result in self.compile_results:
        if th.triton_config_to_hashable(compile_result.config) == best_config_hash:
            compile_result.config.found_by_coordesc = found_by_coordesc  # 2.11 dropped it
            self.compile_results = [compile_result]
            return
    if found_by_coordesc:  # chosen by a descent: not among the compiled configs
        with th.dynamo_timed("CachingAutotuner.slow_precompile_config"):
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best_config)]


def count_triton_compiles() -> Callable[[], int]:
    """Start counting cubins that Triton compiles put into its cache (not the ones an FX
    hit emits straight to disk); returns a function giving the count so far. For the GPU
    tests and benchmarks."""
    from triton.runtime.cache import FileCacheManager

    original = FileCacheManager.put
    count = [0]

    def put(self: Any, data: Any, filename: str, binary: bool = True) -> Any:
        count[0] += filename.endswith(".cubin")
        return original(self, data, filename, binary)

    FileCacheManager.put = put
    return lambda: count[0]


def default_cache_dir(user: str) -> str:
    """Inductor's cache dir for ``user`` when ``TORCHINDUCTOR_CACHE_DIR`` is unset."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def inductor_cache_dir() -> str:
    """Inductor's local cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def process_compile_seconds() -> float:
    """Seconds this process spent in torch.compile: frame compiles plus lazy backward compiles."""
    from torch._dynamo.utils import compilation_time_metrics

    phases = ("_compile.compile_inner", "backward._backward_impl")
    return float(sum(sum(compilation_time_metrics.get(phase, ())) for phase in phases))


def inductor_counters() -> dict[str, int]:
    """A copy of Inductor's counters (fxgraph_cache_hit/miss, ...)."""
    from torch._dynamo.utils import counters

    return dict(counters["inductor"])
