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

:func:`compile_scopes` runs a callback as each compile on a thread ends and as a host
module's build raises, so that what a compile claimed is released where it was taken.
:func:`install_group` puts a received kernel into a manager's directory whole (a directory
of its own, renamed into place, then the group file), and :func:`loader_files` picks the
files a loader reads from a kernel's group (binary and metadata, as
``TRITON_STORE_BINARY_ONLY`` keeps).

Private names, not torch's: Triton's. ``FileCacheManager``'s ``get_group``/``put_group``/
``get_file``/``put`` as ``triton.compile``, ``compile_module_from_src`` and
``Autotuner.check_disk_cache`` call them; ``Autotuner.run``, ``check_disk_cache`` and the
benchmark closure it is given (its free variables ``args`` and ``kwargs``), ``cache_results``,
``base_fn``, ``fn``, ``configs``; ``JITFunction.run``'s ``warmup`` argument
(``run(warmup=True)``) and ``JITFunction._do_compile``; ``triton.compile`` (wrapped where
Inductor calls it); ``runtime._async_compile.AsyncCompileMode``;
``triton.runtime.build._build``; the host modules' file names (``compile_module_from_src``:
``get_file``/``put`` of ``<name><EXT_SUFFIX>``); the group file's layout
(``__grp__<name>``, ``{"child_paths": ...}``); ``knobs.cache.manager_class`` (set to a class
for the session; a descriptor whose instance value overrides the environment). Read from
Triton 3.6.0's and 3.8.0's sources; ran on 3.8.0 (torch 2.14.1's build, CPU tests on the
CPU: compiles to a GPU target, real ``sm_90`` compiles, and the cache calls; a driver that
launches nothing) and 3.6.0 (torch 2.11, one H200: flash-linear-attention and
liger-kernel). The compile scopes, the benchmark closure and the whole install were read
from 3.8.0's source and ran there only. Off where Triton lacks any of the seams
(:func:`triton_cache_unsupported`); where it lacks a scope's function, that scope is not
wrapped, and where the closure lacks the launch's arguments, no config is compiled ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import sysconfig
import threading
import uuid
import weakref
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


@functools.cache
def _import_manager(spec: str) -> type:
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def users_manager_class() -> type | None:
    """The class ``TRITON_CACHE_MANAGER`` names (``module:Class``) when the user set it after
    the session's manager went in (Triton reads the knob's class first), else ``None``."""
    env = os.environ.get("TRITON_CACHE_MANAGER")
    return _import_manager(env) if env else None


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


def _launch_arguments(bench_fn: Any) -> tuple[tuple, dict] | None:
    """The arguments of the launch that tunes, from the benchmark closure ``Autotuner.run``
    hands ``check_disk_cache`` (its free variables ``args`` and ``kwargs``), or ``None``."""
    code, cells = getattr(bench_fn, "__code__", None), getattr(bench_fn, "__closure__", None) or ()
    try:
        free = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells), strict=True))
    except (AttributeError, ValueError):
        return None
    args, kwargs = free.get("args"), free.get("kwargs")
    return (args, kwargs) if isinstance(args, tuple) and isinstance(kwargs, dict) else None


@contextlib.contextmanager
def autotuner_hooks(cache_results: bool, ended: Callable[[bool], None] = lambda failed: None) -> Iterator[None]:
    """Wrap ``Autotuner.run`` and ``check_disk_cache`` for the duration; ``ended(failed)``
    is called on the thread of every ``check_disk_cache`` as it ends (its lookup, compiles
    and benchmark), ``failed`` if it raised.

    An autotuner is changed once, at its first launch, and launches through Triton's own
    ``run`` from then on (an attribute of its own): nothing runs per launch. ``cache_results``:
    an autotuner built without result caching caches them (unless ``TRITON_CACHE_AUTOTUNING=0``
    or Triton's interpreter says otherwise, or Triton's result file would not keep its configs
    exactly, ``_kept_exactly``), so that its result can be looked up; caching changes which
    config runs only in that a result found is used instead of benchmarking again. At the
    end every autotuner is as it was.
    """
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    original_run, original_check = Autotuner.run, Autotuner.check_disk_cache
    turn_on = cache_results and not _autotuning_cache_refused()
    changed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # autotuner -> caching turned on

    @functools.wraps(original_run)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        forced = (turn_on and not self.cache_results and not knobs.runtime.interpret
                  and _kept_exactly(self.configs))
        if forced:
            self.cache_results = True
        self.run = original_run.__get__(self)  # its next launches: Triton's own, directly
        changed[self] = forced
        return original_run(self, *args, **kwargs)

    @functools.wraps(original_check)
    def check_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Any) -> Any:
        outer = getattr(_thread, "tuning", None)
        launch = _launch_arguments(bench_fn)
        _thread.tuning = None if launch is None else Tuning(self, *launch, configs=list(configs))
        failed = True
        try:
            result = original_check(self, tuning_key, configs, bench_fn)
            failed = False
            return result
        finally:
            _thread.tuning = outer
            ended(failed)

    Autotuner.run, Autotuner.check_disk_cache = run, check_disk_cache
    try:
        yield
    finally:
        Autotuner.run, Autotuner.check_disk_cache = original_run, original_check
        for autotuner, forced in list(changed.items()):
            autotuner.__dict__.pop("run", None)
            if forced:
                autotuner.cache_results = False


@contextlib.contextmanager
def compile_scopes(ended: Callable[[], None], build_failed: Callable[[], None]) -> Iterator[None]:
    """For the duration, ``ended()`` runs on a thread as each Triton compile there ends
    (``JITFunction._do_compile``: a ``@triton.jit`` kernel's compile, or its submission to
    an ``AsyncCompileMode``; ``triton.compile``, which Inductor calls), raised or not;
    ``build_failed()`` as a host C module's build raises (``triton.runtime.build._build``).
    Where this Triton lacks one, nothing is wrapped for it."""
    import triton
    from triton.runtime import build
    from triton.runtime.jit import JITFunction

    wrapped = ((JITFunction, "_do_compile"), (triton, "compile"), (build, "_build"))
    originals = [(owner, name, vars(owner)[name]) for owner, name in wrapped if name in vars(owner)]

    def scoped(function: Callable[..., Any], always: bool) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except BaseException:
                if not always:
                    build_failed()
                raise
            finally:
                if always:
                    ended()

        return wrapper

    for owner, name, function in originals:
        setattr(owner, name, scoped(function, always=name != "_build"))
    try:
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


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


#: Files of a compiled kernel no loader reads: its source and IRs (Triton leaves them out
#: itself under ``TRITON_STORE_BINARY_ONLY``). The binary and the metadata stay.
_IR_SUFFIXES = frozenset({"source", "ttir", "ttgir", "llir", "ptx", "amdgcn"})


def loader_files(group: dict[str, str]) -> dict[str, str]:
    """Of a kernel's group (its files' paths by name), the files a loader reads."""
    return {name: path for name, path in group.items() if name.rsplit(".", 1)[-1] not in _IR_SUFFIXES}


def install_group(manager: Any, filename: str, files: dict[str, bytes]) -> dict[str, str] | None:
    """Put kernel group ``filename`` (``files``: its files by name) into ``manager``'s
    directory whole, or not at all, whatever else writes there meanwhile (other ranks,
    Triton itself): the files go into a directory of their own, named after their bytes
    (``coordinator-<digest>``, renamed into place complete, never written again), are checked
    there against ``files``, and only then the group file that names them replaces the
    kernel's group file at once. A reader finds either no group, another writer's, or this
    one complete. Returns the group (paths by name), or ``None`` where it could not be written."""
    target = os.path.normpath(manager.cache_dir)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    home = os.path.join(target, f"coordinator-{digest.hexdigest()[:24]}")
    paths = {name: os.path.join(home, name) for name in files}
    tmp = f"{home}.tmp.{uuid.uuid4().hex}"
    try:
        if not os.path.isdir(home):
            os.makedirs(tmp)
            for name, data in files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            with contextlib.suppress(OSError):  # there already: the same bytes, checked below
                os.rename(tmp, home)
        if not _holds(paths, files):
            log.warning("compile_once: Triton's kernel %s in %s does not hold what was received; compiling it here",
                        filename, home)
            return None
        file_cache_manager().put_group(manager, filename, paths)
    except OSError as exc:
        log.warning("compile_once: could not write Triton's kernel %s into %s: %s", filename, target, exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _holds(paths: dict[str, str], files: dict[str, bytes]) -> bool:
    """Whether each file of ``paths`` holds the bytes of ``files``."""
    try:
        for name, path in paths.items():
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).digest() != hashlib.sha256(files[name]).digest():
                    return False
    except OSError:
        return False
    return True


def installed_module(manager: Any, filename: str, data: bytes) -> str:
    """Write host C module ``filename`` into ``manager``'s directory (one file, renamed into place)."""
    return file_cache_manager().put(manager, data, filename)


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
