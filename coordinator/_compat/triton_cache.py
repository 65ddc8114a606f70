"""Triton's own cache, outside Inductor: its cache-manager seam and its autotuner.

Triton looks every kernel it compiles up in a cache manager it builds per kernel key
(``triton.runtime.cache.get_cache_manager``: the class ``knobs.cache.manager_class`` names,
or ``TRITON_CACHE_MANAGER``, else ``FileCacheManager``). ``triton.compile`` asks
``get_group("<kernel>.json")``; on a miss it compiles, ``put``s each file of the kernel
(IRs, binary, metadata) and ``put_group``s them. An ``Autotuner`` that caches its results
(``cache_results=True``, or ``TRITON_CACHE_AUTOTUNING=1``) asks ``get_file("<kernel>.autotune.json")``
in ``check_disk_cache``; on a miss it benchmarks every config and ``put``s the timings.
The key of a compile hashes the source, options, backend (the GPU's architecture), the
environment and Triton's own version; the autotune key adds the tuning key and the configs.

:func:`routed_triton_cache` installs a manager class for the duration (a class, so Triton
sets no environment variable: Inductor's compile workers keep Triton's file manager), and
:func:`users_cache_manager` says whether the user installed one of their own first.
:func:`autotuner_hooks` wraps ``Autotuner.run`` and ``Autotuner.check_disk_cache``: the
first records each tuning (:class:`Tuning`: the kernel, its arguments, the configs it
searches) for the thread that runs it, and turns result caching on for an autotuner built
without it; the second marks the tuning while Triton looks its result up and benchmarks.
:func:`compile_config` compiles one config of a tuning as its benchmark would, without
launching it (``run(warmup=True)``); :func:`compile_configs` compiles several at once in
threads, through Triton's ``AsyncCompileMode`` (``triton.runtime._async_compile``: the
compile of each runs in an executor's thread, and the kernels enter the kernel cache when
the mode exits).

Private names: ``Autotuner.run``, ``check_disk_cache``, ``cache_results``, ``fn``,
``configs``; ``JITFunction.run``'s ``warmup`` argument; the host modules' file names
(``compile_module_from_src``: ``get_file``/``put`` of ``<name><EXT_SUFFIX>``); ``knobs.cache.manager_class`` (a
descriptor whose instance value overrides the environment). Read from Triton 3.6.0's and
3.8.0's sources; ran on 3.8.0 (torch 2.14.1's build, on the CPU: compiles to a GPU target
and the cache calls) and 3.6.0 (torch 2.11, H200).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: The file an ``Autotuner`` keeps its timings in, per autotune key.
AUTOTUNE_SUFFIX = ".autotune.json"
#: The suffix of the host C modules Triton builds (``triton.runtime.build.compile_module_from_src``:
#: ``<name><EXT_SUFFIX>``, asked with ``get_file`` and saved with ``put``).
HOST_MODULE_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def triton_cache_unsupported() -> str | None:
    """Why this Triton lacks a seam the sharing needs, or ``None``."""
    try:
        from triton import knobs
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.cache import FileCacheManager  # noqa: F401
    except ImportError as exc:
        return f"this Triton lacks {exc.name or exc}"
    if not hasattr(knobs, "cache") or not hasattr(Autotuner, "check_disk_cache"):
        return "this Triton has no cache-manager knob or autotune result cache"
    return None


def file_cache_manager() -> type:
    """Triton's ``FileCacheManager``, the base of a manager that keeps files where Triton does."""
    from triton.runtime.cache import FileCacheManager

    return FileCacheManager


def triton_home_cache_dir() -> str:
    """Where Triton keeps kernels outside Inductor: ``TRITON_CACHE_DIR``, else ``~/.triton/cache``."""
    from triton import knobs

    return knobs.cache.dir


def users_cache_manager() -> str | None:
    """The cache manager a user installed (``TRITON_CACHE_MANAGER``, or ``knobs.cache.manager_class``
    set in the script), as ``module:Class``; ``None`` where Triton uses its own."""
    from triton import knobs

    env = os.environ.get("TRITON_CACHE_MANAGER")
    if env:
        return env
    cls = knobs.cache.__dict__.get("manager_class")
    return None if cls is None else f"{cls.__module__}:{cls.__qualname__}"


@contextlib.contextmanager
def routed_triton_cache(manager: type) -> Iterator[None]:
    """Make Triton build ``manager`` for every kernel key for the duration; at the end the
    knob is as it was, unless the script set a class of its own meanwhile, which stays."""
    from triton import knobs

    missing = object()
    before = knobs.cache.__dict__.get("manager_class", missing)
    knobs.cache.manager_class = manager  # a class: Triton sets no environment variable for it
    try:
        yield
    finally:
        if knobs.cache.__dict__.get("manager_class") is manager:  # one the script set since stays
            if before is missing:
                knobs.cache.__dict__.pop("manager_class", None)
            else:
                knobs.cache.__dict__["manager_class"] = before


@dataclasses.dataclass(eq=False)
class Tuning:
    """One ``Autotuner.run`` that searches configs: what compiling one of them needs."""

    autotuner: Any
    args: tuple
    kwargs: dict
    #: Its result caching was turned on by the session, not by its author.
    forced: bool = False
    #: The configs ``check_disk_cache`` was given (after pruning).
    configs: list = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return getattr(getattr(self.autotuner, "base_fn", None), "__name__", "a Triton kernel")


_thread = threading.local()


def tuning_now() -> Tuning | None:
    """The tuning this thread looks up or benchmarks now (inside ``check_disk_cache``), if any."""
    return getattr(_thread, "tuning", None)


def _autotuning_cache_refused() -> bool:
    """Whether the user turned Triton's autotune caching off explicitly (``TRITON_CACHE_AUTOTUNING=0``)."""
    return os.environ.get("TRITON_CACHE_AUTOTUNING", "").strip().lower() in ("0", "false", "off", "no")


@contextlib.contextmanager
def autotuner_hooks(cache_results: bool, failed: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Wrap ``Autotuner.run`` and ``check_disk_cache`` for the duration; ``failed()`` is
    called on the thread of a ``check_disk_cache`` that raises (its lookup, compiles or
    benchmark), before the error goes on.

    ``cache_results``: an autotuner built without result caching caches them while the hooks
    are in (unless ``TRITON_CACHE_AUTOTUNING=0`` says otherwise), so that its result can be
    looked up; caching changes which config runs only in that a result found is used
    instead of benchmarking again. Where Triton's result file would not keep a config
    exactly (``_kept_exactly``), such an autotuner benchmarks as it would without caching.
    """
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    original_run, original_check = Autotuner.run, Autotuner.check_disk_cache
    turn_on = cache_results and not _autotuning_cache_refused()

    @functools.wraps(original_run)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        # At every launch: only what a tuning needs is kept, and a Tuning is built only when
        # the launch tunes (check_disk_cache).
        outer = getattr(_thread, "run", None)
        flipped = turn_on and not self.cache_results and not knobs.runtime.interpret
        _thread.run = (self, args, kwargs, flipped)
        if flipped:
            self.cache_results = True
        try:
            return original_run(self, *args, **kwargs)
        finally:
            if flipped:
                self.cache_results = False
            _thread.run = outer

    @functools.wraps(original_check)
    def check_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Any) -> Any:
        launch = getattr(_thread, "run", None)
        outer = getattr(_thread, "tuning", None)
        if launch is not None and launch[0] is self:
            if launch[3] and not _kept_exactly(configs):
                bench_fn()  # as Triton does without result caching
                return False
            _thread.tuning = Tuning(self, launch[1], launch[2], forced=launch[3], configs=list(configs))
        try:
            return original_check(self, tuning_key, configs, bench_fn)
        except BaseException:
            failed()
            raise
        finally:
            _thread.tuning = outer

    Autotuner.run, Autotuner.check_disk_cache = run, check_disk_cache
    try:
        yield
    finally:
        Autotuner.run, Autotuner.check_disk_cache = original_run, original_check


def _kept_exactly(configs: Any) -> bool:
    """Whether Triton's result file keeps ``configs`` exactly: it writes each config's fields
    as JSON and builds the configs again from it (a tuple comes back a list, an object not at
    all), so a result read from it would name another config than the one benchmarked."""
    try:
        return all(json.loads(json.dumps(config.__dict__)) == config.__dict__ for config in configs)
    except (TypeError, ValueError):
        return False


def compile_config(tuning: Tuning, config: Any) -> None:
    """Compile ``config`` of ``tuning`` as its benchmark (``Autotuner._bench``) would, without
    launching it: the kernel lands in this process's kernel cache and Triton's cache."""
    current = dict(tuning.kwargs, **config.all_kwargs())
    current["warmup"] = True
    current.setdefault("grid", None)
    tuning.autotuner.fn.run(*tuning.args, **current)


def compile_configs(tuning: Tuning, configs: list, threads: int,
                    each_task: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
    """Compile ``configs`` of ``tuning`` at once in ``threads`` threads, through Triton's own
    ``AsyncCompileMode`` (each config's front end here, its compile in a thread; Triton's
    compiler releases the GIL), as :func:`compile_config` compiles one: every kernel that
    compiles lands in this process's kernel cache, where the benchmark finds it. A config
    whose compile fails is left out of the kernel cache, as Triton leaves it when it compiles
    one itself (Triton 3.8's mode keeps the failed future there): the benchmark meets the
    error itself. Each compile runs inside ``each_task()``, in its thread. Inside another
    ``AsyncCompileMode``, nothing: the caller's mode compiles what it is given."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode, active_mode

    if not configs or active_mode.get() is not None:
        return

    class Tasks(ThreadPoolExecutor):
        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            def task() -> Any:
                with each_task():
                    return fn(*args, **kwargs)

            return super().submit(task)

    try:
        with Tasks(max(1, min(threads, len(configs))), thread_name_prefix="coordinator-triton") as pool, \
                AsyncCompileMode(pool, ignore_errors=True):
            for config in configs:
                with contextlib.suppress(Exception):  # a front-end error: the benchmark meets it
                    compile_config(tuning, config)
    finally:
        _forget_failed_compiles(tuning.autotuner)


def _forget_failed_compiles(autotuner: Any) -> None:
    """Drop from the kernel's caches the compiles that failed in an ``AsyncCompileMode``
    (Triton 3.8 caches the future at once, and a failed one raises at every launch)."""
    fn = autotuner
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
        fn = fn.fn
    for caches in getattr(fn, "device_caches", {}).values():
        kernel_cache = caches[0]
        for key, kernel in list(kernel_cache.items()):
            future = getattr(kernel, "future", None)
            if future is not None and future.done() and future.exception() is not None:
                del kernel_cache[key]


@functools.cache
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def device_kind() -> str:
    """The kind of device this thread's kernels run on (the current CUDA device's name), which
    autotune results are shared within; ``cpu`` without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return _device_name(torch.cuda.current_device())
