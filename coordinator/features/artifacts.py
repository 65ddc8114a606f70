"""Compiled CPU kernels that travel with an FX-graph entry.

On CPU, Inductor's FX-graph cache entry holds the generated Python and C++ source
but not the compiled kernel libraries: a rank that loads the entry in a fresh
process runs the C++ compiler again for every kernel (11.0 s against 1.4 s on the
4-layer test GPT). Inductor writes each compiled kernel to
``<cache dir>/<2 chars>/<hash>[.main].so`` (and ``.o`` objects when it links two),
and skips the compiler when the file exists.

The compiling rank therefore collects the kernel files written into those
directories since it claimed the graph, and ships them inside the entry; a rank that
receives the entry writes them into its own cache dir before Inductor loads the
graph, each through a temporary file and an atomic rename (as
``TritonBundler.read_and_emit`` does for cubins), so it never runs a compiler and a
concurrent reader never sees half a library. Inductor's compiler writes a library in
place, so in a cache dir the ranks of a node share, a file may be one that another rank
is still building: only whole libraries travel or land (:func:`complete_library`: an
ELF file up to its section headers, which the linker writes last).

On CPU each entry also carries the libraries Inductor's probes of the CPU's vector
instructions left (``_compat.isa_probe_libraries``): a rank loading a graph on an empty cache
dir would build them first, a g++ run each, whichever graph it loads first.

On GPUs the FX entry carries its Triton kernels itself (Inductor's Triton bundling), but
not the small C modules Triton builds with the host's compiler beside them, each in a
Triton cache entry of its own: the launcher of each kernel signature that Inductor's
static launcher cannot run (``__triton_launcher``), and the driver's utilities
(``cuda_utils``). A rank that loads the graph on an empty Triton dir would build them
again (0.3 s each on an H100); they travel with the entry (:func:`collect_triton_modules`),
as written by the compile. And one kind of kernel travels apart: a kernel that coordinate
descent tunes at its first launch, after the entry was saved, gets its winning config
compiled then. That kernel's Triton
cache entry (``<triton cache dir>/<hash>/``: cubin, metadata, group file) travels
with the autotune entry instead (:func:`read_triton_kernel`), and the receiver writes
it into its own Triton cache dir as one directory rename (:func:`emit_triton_kernels`),
so Triton finds it there instead of compiling.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable

log = logging.getLogger(__name__)

KERNEL_SUFFIXES = (".so", ".o")
#: Triton autotune results Inductor keeps beside each kernel; Mega-Cache leaves them out.
AUTOTUNE_SUFFIXES = (".best_config",)
_REL_PATH = re.compile(r"^[a-z0-9]{2}/[A-Za-z0-9_.]+$")
#: File times can trail the claim by a little on coarse-grained filesystems.
_MTIME_SLACK_S = 1.0
#: Files of Triton cache entries travel as ``triton/<kernel hash>/<file name>``.
TRITON_PREFIX = "triton/"
_TRITON_REL = re.compile(r"^triton/([A-Za-z0-9_-]+)/([A-Za-z0-9_.-]+)$")
#: Stands for the kernel's directory in the JSON files of a Triton cache entry, which
#: name their cubin and metadata by absolute path (as ``TritonBundler`` does).
_DIR_PLACEHOLDER = b"@coordinator-triton-kernel-dir@"


def _dirs_since(parent: str, since: float) -> list[os.DirEntry]:
    """The directories in ``parent`` modified at or after ``since`` (less a little slack:
    a new file bumps its directory's time); none if ``parent`` is missing."""
    cutoff = since - _MTIME_SLACK_S
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    return [entry for entry in entries if entry.is_dir() and entry.stat().st_mtime >= cutoff]


def collect_kernels(cache_dir: str, since: float, suffixes: tuple[str, ...] = KERNEL_SUFFIXES) -> dict[str, bytes]:
    """Kernel files (or other ``suffixes``) under ``cache_dir`` written at or after ``since``.

    Returns:
        ``{"ab/cabc….so": bytes}``, paths relative to ``cache_dir``.
    """
    cutoff = since - _MTIME_SLACK_S
    found: dict[str, bytes] = {}
    for entry in _dirs_since(cache_dir, since):
        if len(entry.name) != 2:  # kernel dirs are the two-letter hash prefixes
            continue
        for item in os.scandir(entry.path):
            if item.name.endswith(suffixes) and item.is_file() and item.stat().st_mtime >= cutoff:
                with open(item.path, "rb") as f:
                    data = f.read()
                if not item.name.endswith(KERNEL_SUFFIXES) or complete_library(data):
                    found[f"{entry.name}/{item.name}"] = data
    return found


def complete_library(data: bytes) -> bool:
    """Whether ``data`` holds a whole ELF object or library, up to its section headers,
    which linkers write last: a kernel another process of the node is still building in a
    shared cache dir must not travel (a rank that loads a cut file fails: "file too short").
    Data in another format passes, but never an empty or cut-off header."""
    if data[:4] != b"\x7fELF":
        return len(data) > 0 and not b"\x7fELF".startswith(data[:4])
    wide, order = data[4:5] == b"\x02", "little" if data[5:6] == b"\x01" else "big"
    offset, fields = (0x28, 0x3A) if wide else (0x20, 0x2E)
    if len(data) < fields + 4:
        return False
    table = int.from_bytes(data[offset:offset + (8 if wide else 4)], order)
    entry_size = int.from_bytes(data[fields:fields + 2], order)
    entries = int.from_bytes(data[fields + 2:fields + 4], order)
    return table > 0 and len(data) >= table + entry_size * entries


def read_kernels(cache_dir: str, paths: list[str]) -> dict[str, bytes]:
    """The kernel files among ``paths`` (absolute) that lie in ``cache_dir``'s kernel dirs.

    Returns:
        ``{"ab/cabc….so": bytes}``, as :func:`collect_kernels` does.
    """
    found: dict[str, bytes] = {}
    for path in paths:
        rel = os.path.relpath(path, cache_dir)
        if not _REL_PATH.match(rel) or not rel.endswith(KERNEL_SUFFIXES) or rel in found:
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        if complete_library(data):
            found[rel] = data
    return found


def emit_kernels(cache_dir: str, files: dict[str, bytes], suffixes: tuple[str, ...] = KERNEL_SUFFIXES) -> int:
    """Write ``files`` into ``cache_dir`` atomically, keeping any that already exist.

    Returns:
        The number of files written.
    """
    written = 0
    for rel, data in files.items():
        if not _REL_PATH.match(rel) or not rel.endswith(suffixes):
            log.warning("ignoring unexpected cache file path %r in a received entry", rel)
            continue
        path = os.path.join(cache_dir, rel)
        if os.path.exists(path):
            continue
        if rel.endswith(KERNEL_SUFFIXES) and not complete_library(data):
            log.warning("ignoring a cut-off kernel library %r in a received entry; Inductor will build it", rel)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        written += 1
    return written


def triton_entry_file(name: str) -> bool:
    """Whether ``name`` names a file of a Triton cache entry (``triton/<hash>/<file>``)."""
    return _TRITON_REL.match(name) is not None


def read_triton_kernel(directory: str) -> dict[str, bytes]:
    """The files of one Triton cache entry (``<triton cache dir>/<kernel hash>/``).

    Returns:
        ``{"triton/<kernel hash>/<file name>": bytes}``, the directory's own path in
        JSON files replaced by a placeholder; empty if the directory is missing.
    """
    directory = os.path.normpath(directory)
    name = os.path.basename(directory)
    found: dict[str, bytes] = {}
    try:
        items = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    groups = []
    for item in items:
        rel = f"{TRITON_PREFIX}{name}/{item.name}"
        if not item.is_file() or not _TRITON_REL.match(rel):
            continue
        if item.name.startswith("__grp__"):
            groups.append((rel, item.path))
            continue
        with open(item.path, "rb") as f:
            data = f.read()
        if item.name.endswith(".json"):
            data = data.replace(directory.encode(), _DIR_PLACEHOLDER)
        found[rel] = data
    for rel, path in groups:  # a group's own files, wherever it keeps them (a received one: a dir of its own)
        try:
            with open(path, "rb") as f:
                children = json.loads(f.read())["child_paths"]
            for child, child_path in children.items():
                with open(child_path, "rb") as f:
                    found[f"{TRITON_PREFIX}{name}/{child}"] = f.read()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # removed meanwhile, or not a group: left out
        placed = {child: os.path.join(_DIR_PLACEHOLDER.decode(), child) for child in children}
        found[rel] = json.dumps({"child_paths": placed}).encode()
    return found


#: Triton cache entries that hold a C module built on the host, by the module's name.
TRITON_HOST_MODULES = ("__triton_launcher", "cuda_utils")


def collect_triton_modules(triton_dir: str, since: float) -> dict[str, bytes]:
    """The Triton cache entries of host C modules (:data:`TRITON_HOST_MODULES`) written
    into ``triton_dir`` at or after ``since``, as :func:`read_triton_kernel` reads them."""
    found: dict[str, bytes] = {}
    for entry in _dirs_since(triton_dir, since):
        try:
            names = os.listdir(entry.path)
        except FileNotFoundError:  # a temporary dir renamed meanwhile
            continue
        if not entry.name.startswith("tmp") and any(name.startswith(TRITON_HOST_MODULES) for name in names):
            found.update(read_triton_kernel(entry.path))
    return found


def emit_triton_kernels(triton_dir: str, files: dict[str, bytes]) -> int:
    """Write the Triton cache entries among ``files`` into ``triton_dir``.

    Each entry is written into a temporary directory and renamed into place, so a
    concurrent Triton never sees half of one; an entry already present is kept.

    Returns:
        The number of Triton cache entries written.
    """
    kernels: dict[str, dict[str, bytes]] = {}
    for rel, data in files.items():
        match = _TRITON_REL.match(rel)
        if match is None:
            log.warning("ignoring unexpected Triton cache path %r in a received entry", rel)
            continue
        kernels.setdefault(match.group(1), {})[match.group(2)] = data
    written = 0
    for name, contents in kernels.items():
        target = os.path.join(triton_dir, name)
        if os.path.isdir(target) and os.listdir(target):
            continue
        os.makedirs(triton_dir, exist_ok=True)
        tmp = os.path.join(triton_dir, f"tmp.coordinator.{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            for filename, data in contents.items():
                if filename.endswith(".json"):
                    data = data.replace(_DIR_PLACEHOLDER, os.path.normpath(target).encode())
                with open(os.path.join(tmp, filename), "wb") as f:
                    f.write(data)
            os.replace(tmp, target)
            written += 1
        except OSError:  # another process put it there first
            if not (os.path.isdir(target) and os.listdir(target)):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return written


class ShippedKernels:
    """One process's side of kernel shipping: which C++ kernels (and on a GPU, Triton's
    host modules) an FX graph's compile built or resolved (to send with its entry),
    writing received ones, and the record of every kernel file and compile second this
    process compiled or received, which a whole-job bundle carries (``coordinator.bundles``)."""

    def __init__(self, cache_dir: Callable[[], str], triton_dir: Callable[[], str],
                 gpu: Callable[[], bool] = lambda: False, probes: Callable[[], list[str]] = list) -> None:
        self._cache_dir = cache_dir
        self._triton_dir = triton_dir
        self._gpu = gpu
        #: The libraries of Inductor's probes of the CPU (``_compat.isa_probe_libraries``).
        self._probes = probes
        #: Wall-clock time of each FX miss this process compiles without a claim.
        self._missed_at: dict[str, float] = {}
        #: C++ kernel libraries resolved on each thread since its last FX miss.
        self._resolved = threading.local()
        #: Kernel files this rank compiled or received, and the compile seconds of the FX
        #: graphs it compiled or received.
        self.files: set[str] = set()
        self.compile_time_s = 0.0
        #: Triton cache entries (directories) of kernels and tunings outside Inductor this
        #: rank compiled or received (``coordinator.features.triton_kernels``).
        self.triton_entries: set[str] = set()

    def missed(self, key: str) -> None:
        """This thread compiles FX graph ``key`` now: kernels from here on travel with it."""
        self._missed_at[key] = time.time()
        self._resolved.paths = []

    def resolved(self, path: str) -> None:
        """Inductor resolved the C++ kernel library ``path`` on this thread
        (``_compat.cpu_kernels_resolved``)."""
        paths = getattr(self._resolved, "paths", None)
        if paths is not None:
            paths.append(path)

    def forget(self, key: str) -> float | None:
        """Stop tracking ``key``; returns when it missed, if it did."""
        return self._missed_at.pop(key, None)

    def built_for(self, key: str, claimed_at: float | None) -> dict[str, bytes]:
        """What the compile of ``key`` built (files written since its claim or miss) and
        the kernels it found built already, by an earlier graph: a rank may load this
        graph before that one."""
        missed_at = self.forget(key)
        since = claimed_at or missed_at
        if since is None:
            return {}
        resolved, self._resolved.paths = getattr(self._resolved, "paths", None) or [], None
        cache_dir = self._cache_dir()
        files = {**read_kernels(cache_dir, resolved), **collect_kernels(cache_dir, since)}
        if self._gpu():
            files.update(collect_triton_modules(self._triton_dir(), since))
        else:  # a receiver that loads this graph first on an empty dir probes nothing
            files.update(read_kernels(cache_dir, self._probes()))
        return files

    def read(self, paths: list[str]) -> dict[str, bytes]:
        """The kernel files among ``paths`` (a local hit's)."""
        return read_kernels(self._cache_dir(), paths)

    def read_recorded(self) -> dict[str, bytes]:
        """Every kernel file this process compiled or received (``files``)."""
        cache_dir = self._cache_dir()
        return read_kernels(cache_dir, [os.path.join(cache_dir, rel) for rel in sorted(self.files)])

    def emit(self, files: dict[str, bytes]) -> int:
        """Write received kernel files into this process's caches; returns how many."""
        triton = {rel: data for rel, data in files.items() if rel.startswith(TRITON_PREFIX)}
        cpu = {rel: data for rel, data in files.items() if rel not in triton}
        written = emit_kernels(self._cache_dir(), cpu)
        if triton:
            written += emit_triton_kernels(self._triton_dir(), triton)
        return written

    def record_triton(self, directory: str) -> None:
        """A Triton cache entry outside Inductor this process compiled or received, for the job's bundle."""
        self.triton_entries.add(directory)

    def read_triton(self) -> dict[str, bytes]:
        """Every Triton cache entry of :attr:`triton_entries`, as :func:`read_triton_kernel` reads them."""
        files: dict[str, bytes] = {}
        for directory in sorted(self.triton_entries):
            files.update(read_triton_kernel(directory))
        return files

    def record(self, kind: str, files: dict[str, bytes], compile_time_s: float) -> None:
        """An entry this process compiled or received, for the job's bundle: every FX
        graph with its compile time, and the kernels any other kind's entry carries."""
        self.files.update(files)
        if kind == "fx_graph":
            self.compile_time_s += compile_time_s
