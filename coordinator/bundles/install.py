"""A verified bundle into this node's caches: kernels into the Inductor cache dir, Triton's
entries outside Inductor into Triton's cache dir, the Mega-Cache into torch, once per node
however many ranks ask."""

from __future__ import annotations

import hashlib
import os
import time

from coordinator import _compat
from coordinator.bundles.format import Bundle
from coordinator.bundles.keys import bundle_key
from coordinator.bundles.transfer import fetch_bundle
from coordinator.features.artifacts import AUTOTUNE_SUFFIXES, emit_kernels, emit_triton_kernels
from coordinator.protocol.node import file_lock, record_bundled
from coordinator.settings import Config


def install_bundle(bundle: Bundle) -> dict:
    """Write a verified bundle into the local caches (temp file + rename, existing files
    left alone; the Mega-Cache bytes to ``torch.compiler.load_cache_artifacts``), noting
    the FX graphs it installed (``coordinator.protocol.node.record_bundled``: a rank that
    then finds one in its local cache counts the compile it saved); extend NCCL timeouts.

    Returns:
        ``{"files_written", "megacache_bytes", "graphs", "compile_time_s", "timeout_extension_s"}``.
    """
    cache_dir = _compat.inductor_cache_dir()
    written = emit_kernels(cache_dir, bundle.kernels)
    written += emit_kernels(cache_dir, bundle.autotune, AUTOTUNE_SUFFIXES)
    if bundle.triton:
        # Where Triton looks now (TRITON_CACHE_DIR, or its default), and where it looks once
        # Inductor has pointed TRITON_CACHE_DIR at its own dir.
        for triton_dir in dict.fromkeys((_compat.triton_home_cache_dir(), _compat.triton_cache_dir())):
            written += emit_triton_kernels(triton_dir, bundle.triton)
    graphs = _compat.load_cache_artifacts(bundle.megacache) if bundle.megacache else []
    record_bundled(cache_dir, graphs)
    extension = _compat.extend_nccl_timeouts(bundle.compile_time_s)
    return {
        "files_written": written,
        "megacache_bytes": len(bundle.megacache),
        "graphs": len(graphs),
        "compile_time_s": bundle.compile_time_s,
        "timeout_extension_s": extension,
    }


def load_bundle(url: str, *, name: str = "default", secret: str | bytes | None = None,
                config: Config | None = None) -> dict:
    """Fetch, verify and install bundle ``name``, once per node.

    The first process on a node to get the node-local lock (in the Inductor cache dir)
    fetches and installs; the others wait on the lock and find the bundle installed.
    ``config`` gives the secret and namespace (see :mod:`coordinator.bundles.keys`).

    Returns:
        ``{"fetched": bool, ...}`` with :func:`install_bundle`'s figures when fetched, and
        the seconds it took to fetch and verify (``fetch_s``) and to install (``install_s``).
    """
    cache_dir = _compat.inductor_cache_dir()
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""
    tag = hashlib.sha256(f"{url}\0{bundle_key(name, secret=secret, config=config)}\0{job}".encode()).hexdigest()[:16]
    marker = os.path.join(cache_dir, f".coordinator-bundle-{tag}.done")
    with file_lock(os.path.join(cache_dir, ".coordinator-bundle.lock"), None):
        if os.path.exists(marker):
            return {"fetched": False}
        started = time.monotonic()
        bundle = fetch_bundle(url, name=name, secret=secret, config=config)
        fetched = time.monotonic()
        result = install_bundle(bundle)
        with open(marker, "w") as f:
            f.write(str(time.time()))
        return {"fetched": True, **result, "fetch_s": round(fetched - started, 3),
                "install_s": round(time.monotonic() - fetched, 3)}


def described(result: dict) -> str:
    """:func:`load_bundle`'s result in words, as ``coordinator-run`` logs it."""
    if not result.get("fetched"):
        return "installed on this node already"
    seconds = result["fetch_s"] + result["install_s"]
    return (f"installed {result['files_written']} files and {result['graphs']} graphs "
            f"({result['megacache_bytes'] / 1e6:.1f} MB of Mega-Cache) in {seconds:.2f}s; it saves "
            f"{result['compile_time_s']:.1f}s of compiles, NCCL timeouts extended by "
            f"{result['timeout_extension_s']:.1f}s")
