"""The autotune-hold protocol, Triton's side: the patches around a kernel's first-launch tuning.

A Triton kernel tunes at its first launch: it compiles its configs (``precompile``), searches
them (``autotune_to_one_config``), then, with coordinate descent on, refines the winner
(``coordinate_descent_tuning``). :func:`triton_tuning_hooks` patches the search and the
descent to call a tuner's ``search`` and ``descend`` (``coordinator.features.kernel_tuning``
decides what runs: adopt a config another rank published, or tune inside a tuning step)
with the kernel seen through :class:`TunedKernel` and the original method; an autotune save
asks the tuner whether to hold it (:func:`defer_autotune_save`). Kernels compiled in
compile workers and static autotuners restored from FX entries get their autotune cache
routed to the coordinator too (``route_autotune_cache``), and a config a worker found in
this rank's own cache is shared under the key a loader looks it up by
(``share_config_kept_from_cache``).

Private names: ``CachingAutotuner.autotune_to_one_config``, ``coordinate_descent_tuning``,
``recheck_autotune_cache``, ``restore_after_unpickle``, ``precompile``, ``save_cache_hook``,
``configs``/``compile_results``, ``filename``, ``inductor_meta``, ``triton_meta["device"]``;
``AutotuneCache._prepare_key``, ``_setup_remote_autotune_cache``, ``remote_cache``,
``configs_hash``, ``_read``, ``read_best``; ``hash_configs``, ``check_autotune_cache``. 2.14
adds ``CachingAutotuner._could_rblock_scale``, read by ``recheck_autotune_cache``.

Checked: read from 2.13.0's source and from 2.11.0's too; the ``read_best``/
``recheck_autotune_cache`` backports (pytorch#172819, ``versions.FIXED_IN``) apply before
2.12. GPU tier on 2.11.0 (all four cases).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from coordinator._compat.caches import inductor_cache_dir
from coordinator._compat.versions import needs_fix

log = logging.getLogger(__name__)


class Tuner(Protocol):
    """What the hooks call back (``coordinator.features.kernel_tuning.KernelTuning``)."""

    def search(self, kernel: TunedKernel, tune: Callable[[], Any]) -> Any: ...

    def descend(self, kernel: TunedKernel, launcher: Any, descend: Callable[[], Any]) -> Any: ...

    def defer_save(self, publish: Callable[[dict[str, bytes]], None]) -> bool: ...

    def saves_published_now(self) -> contextlib.AbstractContextManager[None]: ...

    def close(self) -> None: ...


#: The tuner of the hooks installed now (CachingAutotuner's methods are patched process-wide).
_installed: Tuner | None = None


def defer_autotune_save(publish: Callable[[dict[str, bytes]], None]) -> bool:
    """Ask the installed tuner whether to hold an autotune entry Inductor is saving
    (``KernelTuning.defer_save``), if hooks are installed.

    Returns:
        True if held; False if the caller should publish now.
    """
    return _installed is not None and _installed.defer_save(publish)


def _saves_published_now() -> contextlib.AbstractContextManager[None]:
    """On this thread, for the duration, an autotune save publishes at once even inside
    a tuning step that holds its saves."""
    return _installed.saves_published_now() if _installed is not None else contextlib.nullcontext()


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
def triton_tuning_hooks(tuner: Tuner) -> Iterator[None]:
    """Call ``tuner`` around each Triton kernel's first-launch tuning, for the duration
    (:class:`TritonTuningHooks`)."""
    global _installed
    hooks = TritonTuningHooks(tuner)
    previous, _installed = _installed, tuner
    try:
        with hooks.installed():
            yield
    finally:
        _installed = previous


class TunedKernel:
    """A ``CachingAutotuner`` tuning at its first launch, as the tuner sees it
    (``coordinator.features.kernel_tuning.TunedKernel``)."""

    __slots__ = ("autotuner",)

    def __init__(self, autotuner: Any) -> None:
        self.autotuner = autotuner

    @property
    def name(self) -> str | None:
        return self.autotuner.inductor_meta.get("kernel_name")

    @property
    def refined_by_descent(self) -> bool:
        return bool(self.autotuner.inductor_meta.get("coordinate_descent_tuning"))

    @property
    def descended(self) -> bool:
        return getattr(self.autotuner, "_coordinator_descended", False)

    @descended.setter
    def descended(self, value: bool) -> None:
        self.autotuner._coordinator_descended = value

    def descends_next(self) -> bool:  # run() calls coordinate_descent_tuning next
        launchers = getattr(self.autotuner, "launchers", None) or [None]
        return self.refined_by_descent and not getattr(getattr(launchers[0], "config", None), "found_by_coordesc",
                                                       False)

    def published_config(self) -> Any:
        return _published_config(self.autotuner)

    def adopt(self, config: Any) -> Any:
        return adopt_config(self.autotuner, config)

    @staticmethod
    def found_by_descent(config: Any) -> bool:
        return bool(getattr(config, "found_by_coordesc", False))

    @staticmethod
    def config_of(launcher: Any) -> Any:
        return getattr(launcher, "config", None)

    def kernel_dir(self, launcher: Any) -> str | None:
        kernel_hash = getattr(launcher, "cache_hash", None)
        if not kernel_hash:
            return None
        return os.path.join(triton_cache_dir(self.autotuner.triton_meta.get("device", 0)), kernel_hash)


class TritonTuningHooks:
    """Each Triton kernel's first-launch tuning handed to a tuner.

    A kernel with several configs searches them (``CachingAutotuner.autotune_to_one_config``)
    and, where coordinate descent is on, then descends from the winner
    (``coordinate_descent_tuning``); both run in ``CachingAutotuner.run`` at the first
    launch. Each calls the tuner (``search``, ``descend``) with the kernel and the original
    method; the tuner runs the kernel's tuning step around them and may adopt a config
    another rank published instead (:func:`adopt_config`).

    Also wraps ``restore_after_unpickle`` to route the autotune cache of kernels compiled
    in compile workers, and of static autotuners from FX entries as they are rechecked
    (:func:`route_autotune_cache`), and shares the config of a worker kernel that found it
    in this rank's own cache under the key its loaders look up
    (:func:`share_config_kept_from_cache`). On torch < 2.12 also fixes how Inductor
    restores a config that coordinate descent chose (pytorch/pytorch#172819):
    :func:`_read_best_fixed` and :func:`_recheck_autotune_cache_fixed`.
    """

    _PATCHED = ("autotune_to_one_config", "coordinate_descent_tuning", "recheck_autotune_cache",
                "restore_after_unpickle")

    def __init__(self, tuner: Tuner) -> None:
        self._tuner = tuner
        self._originals: dict[str, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Patch ``CachingAutotuner`` (and, before 2.12, ``AutotuneCache.read_best``)."""
        from torch._inductor.runtime import triton_heuristics as th
        from torch._inductor.runtime.autotune_cache import AutotuneCache

        autotuner = th.CachingAutotuner
        self._originals = {name: autotuner.__dict__[name] for name in self._PATCHED if name in autotuner.__dict__}
        original_read_best = AutotuneCache.__dict__["read_best"]
        for name in self._originals:
            setattr(autotuner, name, self._patched(name))
        if needs_fix("pytorch#172819"):
            AutotuneCache.read_best = _read_best_fixed
        try:
            yield
        finally:
            for name, original in self._originals.items():
                setattr(autotuner, name, original)
            AutotuneCache.read_best = original_read_best
            self._tuner.close()

    def _patched(self, name: str) -> Callable[..., Any]:
        method = getattr(self, "_" + name)

        def patched(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            return method(kernel, *args, **kwargs)

        return patched

    def _restore_after_unpickle(self, kernel: Any, old_values: Any) -> None:
        self._originals["restore_after_unpickle"](kernel, old_values)
        if old_values is None:  # a kernel compiled in a compile worker, arriving in this process
            route_autotune_cache(kernel)
            share_config_kept_from_cache(kernel)

    def _autotune_to_one_config(self, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["autotune_to_one_config"]
        return self._tuner.search(TunedKernel(kernel), lambda: original(kernel, *args, **kwargs))

    def _coordinate_descent_tuning(self, kernel: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["coordinate_descent_tuning"]
        return self._tuner.descend(TunedKernel(kernel), launcher, lambda: original(kernel, launcher, *args, **kwargs))

    def _recheck_autotune_cache(self, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        # A static autotuner from an FX entry names the kernel file of the process that
        # compiled it; Inductor derives the kernel's local autotune file from that path.
        # On one host with per-rank cache dirs, this rank would read the compiling
        # rank's file, mid-tuning (before coordinate descent). Point it at our own copy.
        if getattr(kernel, "filename", None):
            kernel.filename = os.path.join(inductor_cache_dir(), *os.path.normpath(kernel.filename).split(os.sep)[-2:])
        # The recheck looks the config up through a cache of its own, but the kernel saves
        # through the one pickled into the FX entry: route that one too, or this rank's
        # tuned config would never reach the store.
        route_autotune_cache(kernel)
        if needs_fix("pytorch#172819"):
            return _recheck_autotune_cache_fixed(kernel, *args, **kwargs)
        return self._originals["recheck_autotune_cache"](kernel, *args, **kwargs)


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
    this rank's local file. (On torch 2.11 ``autotune_cache_info`` does not report such a
    hit, and ``configs`` is already cleared, so neither can tell it.)
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
        with _saves_published_now():  # never held as a tuning step's result
            remote.put(key, {**cached, "configs_hash": kept_hash})
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
