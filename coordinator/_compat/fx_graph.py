"""FX-graph lookups: keep remote hits in Inductor's local cache, report every hit, say
whether a lookup loads an AOTAutograd entry's graph, and keep rank-dependent graphs out of
the local cache; FX entries that bundle only the Triton kernels their code launches; the
C++ kernels a graph resolves.

Private names: :func:`fx_graph_lookups`: ``FxGraphCache._lookup_graph``,
``_write_to_local_cache``, ``_get_tmp_dir_for_key``, ``codecache._worker_compile_cpp``,
``RedisRemoteCache._get_key`` and the FX remote value format of ``_save_graph``
(``{"data": <base64>, ...}``); the compile time a hit's entry records
(``CompiledFxGraph._time_taken_ns``, the one Inductor's own ``time_saved_ns`` reads).
Whether a lookup loads an AOTAutograd entry's graph (:func:`in_aot_entry_load`):
``_lookup_graph``'s ``evaluate_guards``, which only ``FxGraphCacheLoadable.load`` passes
(2.13.0; without the parameter, never). Entries that bundle only the Triton kernels their
code launches (:func:`bundles_of_final_kernels`): ``FxGraphCache._save_graph``,
``CompiledFxGraph._triton_bundle``/``source_code``, ``TritonBundle.kernel_artifacts`` (a
dataclass), ``TritonKernelArtifact.filename``. The C++ kernels a graph resolves
(:func:`cpu_kernels_resolved`): ``CppCodeCache.load_async``, ``codecache.write`` and its
``main.cpp`` naming.

Checked: 2.11.0 does not keep remote hits in its local cache itself; keeping them ran in
the GPU tier on 2.11.0. ``cpu_kernels_resolved`` read from 2.11.0's and 2.14.1's sources,
ran on 2.13.0 and 2.14.1 (CPU tests). 2.13 already drops the losing configs of kernels it
tuned (``TritonBundler.put_winner``), not untuned template choices. Ran in the GPU tier and
the max-autotune benchmark on 2.11.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from coordinator._compat.backward import SkipCompile

log = logging.getLogger(__name__)

_lookups = threading.local()


def in_aot_entry_load() -> bool:
    """Whether this thread's FX-graph lookup loads a graph of an AOTAutograd cache entry
    (``FxGraphCacheLoadable.load``), whose miss compiles nothing there: AOTAutograd then
    compiles the graph afresh and looks it up again (the forward at once, a backward at its
    first call). Known inside ``fx_graph_lookups``: AOTAutograd passes its own guard check
    (``evaluate_guards``) to ``FxGraphCache._lookup_graph``, Inductor's own lookup none."""
    return getattr(_lookups, "aot_entry", False)


class _RecordingRemoteCache:
    """Inductor's remote cache, remembering what its ``get`` returned."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.value: Any = None
        self.skip: SkipCompile | None = None

    def get(self, key: str) -> Any:
        try:
            self.value = self._cache.get(key)
        except SkipCompile as exc:  # Inductor would log it and compile: raised after the lookup
            self.skip = exc
            return None
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
    served: Callable[..., None] | None = None,
    keep_locally: Callable[[str], bool] | None = None,
) -> Iterator[None]:
    """Keep FX graphs from remote hits in Inductor's local cache, call
    ``served(key, remote_value, kernel_files, local_key=, compile_s=)`` (if given) after
    each FX-graph cache hit,
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
    the entry). ``local_key`` is Inductor's own key of the graph
    (``FxGraphCache._lookup_graph``'s, the one Mega-Cache names), ``compile_s`` the compile
    time recorded with the entry (``CompiledFxGraph._time_taken_ns``; 0 if none). A
    ``SkipCompile`` the backend raises ends the lookup with it (Inductor would log it and
    compile).
    """
    from torch._inductor import codecache

    fx_cache = codecache.FxGraphCache
    original_lookup = fx_cache.__dict__["_lookup_graph"]
    original_write = fx_cache.__dict__["_write_to_local_cache"]
    original_worker = codecache._worker_compile_cpp
    recording = threading.local()

    def write_to_local_cache(key: str, content: bytes) -> None:
        if keep_locally is None or keep_locally(key):
            original_write.__func__(key, content)
        else:
            log.debug("not keeping FX graph %s in the local cache", key)

    fx_cache._lookup_graph = staticmethod(_lookup_graph_patch(fx_cache, original_lookup, recording, served))
    fx_cache._write_to_local_cache = staticmethod(write_to_local_cache)
    codecache._worker_compile_cpp = _worker_compile_cpp_patch(original_worker, recording)
    try:
        yield
    finally:
        fx_cache._lookup_graph = original_lookup
        fx_cache._write_to_local_cache = original_write
        codecache._worker_compile_cpp = original_worker


def _worker_compile_cpp_patch(original_worker: Callable[..., None], recording: threading.local) -> Callable[..., None]:
    """``codecache._worker_compile_cpp`` that also records its builders' target files
    in ``recording.files`` while a lookup records them."""

    def worker_compile_cpp(*args: Any, **kwargs: Any) -> None:
        # (lock_path, builders) on 2.13; (lock_path, builder, ...) in some earlier versions.
        files = getattr(recording, "files", None)
        if files is not None:
            for arg in args[1:]:
                for builder in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if hasattr(builder, "get_target_file_path"):
                        files.append(builder.get_target_file_path())
        return original_worker(*args, **kwargs)

    return worker_compile_cpp


def _lookup_graph_patch(fx_cache: Any, original_lookup: Any, recording: threading.local,
                        served: Callable[..., None] | None,
                        ) -> Callable[..., Any]:
    """``FxGraphCache._lookup_graph`` as :func:`fx_graph_lookups` wraps it."""
    parameters = list(inspect.signature(original_lookup.__func__).parameters)
    guards_at = parameters.index("evaluate_guards") - 4 if "evaluate_guards" in parameters else None

    def lookup_graph(key: str, example_inputs: Any, local: bool, remote_cache: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(recording, "files", None)
        recording.files = files = []
        remote = _RecordingRemoteCache(remote_cache) if remote_cache else remote_cache
        guards = kwargs.get("evaluate_guards")
        if guards is None and guards_at is not None and len(args) > guards_at:
            guards = args[guards_at]
        outer_aot_entry, _lookups.aot_entry = in_aot_entry_load(), guards is not None
        try:
            result = original_lookup.__func__(key, example_inputs, local, remote, *args, **kwargs)
        finally:
            recording.files = outer
            _lookups.aot_entry = outer_aot_entry
        if remote is not None and remote.skip is not None:
            raise remote.skip
        graph = result[0] if isinstance(result, tuple) else result  # (graph, cache info) since 2.6
        # Local entries are read first: a remote value means the local ones missed.
        if graph is not None and local and remote and remote.value is not None:
            _keep_locally(fx_cache, key, remote.value)
        if served is not None and graph is not None:
            _report_hit(served, fx_cache, key, graph, remote_cache, files)
        return result

    return lookup_graph


def _report_hit(served: Callable[..., None], fx_cache: Any, key: str,
                graph: Any, remote_cache: Any, files: list[str]) -> None:
    """Tell ``served`` about a hit, under the key our backend sees: Inductor's Redis-style
    remote caches format it (``pt2:fx-graph-v1::<key>:c1``). Without a remote cache there
    is no backend, and nothing to tell."""
    get_key = getattr(remote_cache, "_get_key", None)
    if get_key is None:
        return

    def remote_value() -> bytes | None:
        entry = _local_fx_entry(fx_cache, key)
        return None if entry is None else fx_graph_remote_value(entry, getattr(graph, "_time_taken_ns", None))

    time_taken_ns = getattr(graph, "_time_taken_ns", None)
    try:
        served(get_key(key), remote_value, files, local_key=key, compile_s=(time_taken_ns or 0) / 1e9)
    except Exception:  # the coordinator never fails a cache hit
        log.warning("compile_once: handling the FX cache hit for %s failed", key, exc_info=True)


@contextlib.contextmanager
def cpu_kernels_resolved(record: Callable[[str], None]) -> Iterator[None]:
    """Call ``record(path)`` with the library of each C++ kernel Inductor resolves, on
    the thread that resolves it: compiled now, found on disk, or already loaded by an
    earlier graph of this process (which is why the files a graph's compile writes are
    not all it needs: a kernel identical to one of an earlier graph is not built again).

    Wraps ``CppCodeCache.load_async`` and, inside it, ``codecache.write``, whose
    ``main.cpp`` path names the library (``<key>.main.cpp`` -> ``<key>.main.so``).
    """
    from torch._inductor import codecache

    cpp_cache = codecache.CppCodeCache
    original_load = cpp_cache.__dict__["load_async"]
    original_write = codecache.write
    inside = threading.local()

    def write(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
        key, path = original_write(content, extension, *args, **kwargs)
        if getattr(inside, "depth", 0) and extension == "main.cpp" and path.endswith(".cpp"):
            try:
                record(path[: -len(".cpp")] + ".so")
            except Exception:  # never fail a compile over bookkeeping
                log.debug("could not record C++ kernel %s", path, exc_info=True)
        return key, path

    def load_async(cls: Any, *args: Any, **kwargs: Any) -> Any:
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            return original_load.__func__(cls, *args, **kwargs)
        finally:
            inside.depth -= 1

    cpp_cache.load_async = classmethod(load_async)
    codecache.write = write
    try:
        yield
    finally:
        cpp_cache.load_async = original_load
        codecache.write = original_write


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


@contextlib.contextmanager
def bundles_of_final_kernels() -> Iterator[None]:
    """Save FX entries whose Triton bundle holds only the kernels their code launches.

    Inductor bundles into an FX entry every Triton kernel compiled during the graph's
    compile (``TritonBundler.collect``): in max-autotune, the binaries of every GEMM
    template choice it benchmarked, the losers too (on torch 2.11, 88 MB per graph of
    the 4-layer GPT). A rank that loads the entry runs only the kernels its code names.
    Wraps ``FxGraphCache._save_graph``: while it pickles the graph, the bundle keeps the
    kernels whose binary's name is one the graph's ``source_code`` compiles
    (``async_compile.triton('<name>', ...)``), with all their configs, and every kernel
    without a binary; the graph in memory keeps its bundle. A rank that selects again
    (a different input, a new process without the entry) compiles its choices itself.
    """
    from torch._inductor import codecache

    fx_cache = codecache.FxGraphCache
    original_save = fx_cache.__dict__["_save_graph"]

    def save_graph(key: str, compiled_graph: Any, *args: Any, **kwargs: Any) -> Any:
        bundle = getattr(compiled_graph, "_triton_bundle", None)
        source = getattr(compiled_graph, "source_code", None)
        kept = _final_kernel_artifacts(bundle, source)
        if kept is None:
            return original_save.__func__(key, compiled_graph, *args, **kwargs)
        compiled_graph._triton_bundle = dataclasses.replace(bundle, kernel_artifacts=kept)
        try:
            return original_save.__func__(key, compiled_graph, *args, **kwargs)
        finally:
            compiled_graph._triton_bundle = bundle

    fx_cache._save_graph = staticmethod(save_graph)
    try:
        yield
    finally:
        fx_cache._save_graph = original_save


#: Extensions of a Triton kernel's binary in its cache dir (``GPU_KERNEL_BIN_EXTS``).
_BINARY_EXTENSIONS = (".cubin", ".hsaco", ".zebin", ".spv")


def _final_kernel_artifacts(bundle: Any, source: str | None) -> list[Any] | None:
    """The kernel artifacts of ``bundle`` that ``source`` launches, or ``None`` to keep
    the bundle as it is (nothing to drop, or not a bundle this understands)."""
    artifacts = getattr(bundle, "kernel_artifacts", None)
    if not artifacts or not isinstance(source, str) or not dataclasses.is_dataclass(bundle):
        return None
    kept = []
    for kernel in artifacts:
        names = {os.path.splitext(artifact.filename)[0] for artifact in kernel.artifacts
                 if artifact.filename.endswith(_BINARY_EXTENSIONS)}
        if not names or any(f"'{name}'" in source or f'"{name}"' in source for name in names):
            kept.append(kernel)
    if len(kept) == len(artifacts):
        return None
    log.debug("FX entry bundles %d of %d Triton kernels (the others are not in its code)", len(kept), len(artifacts))
    return kept
