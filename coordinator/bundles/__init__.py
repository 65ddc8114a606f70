"""Whole-job bundles: every compiled artifact of a job in one verified container.

``compile_once`` shares graphs one at a time while a job runs. A bundle carries the
whole set at once, for ranks that start later (elastic restarts, a replacement node,
the next job) and for large clusters, where NCCL moves the bytes down a tree at link
speed instead of thousands of ranks reading one store.

Layout (msgpack)::

    [MAGIC, header, artifacts, hmac_sha256(secret, header) | nil]
    header    = msgpack({"format", "environment", "created", "compile_time_s",
                         "artifacts": {name: {"sha256", "size"}}})
    artifacts = {"megacache": torch.compiler.save_cache_artifacts() bytes,
                 "kernel/<ab>/<file>.so": compiled CPU kernel, ...,
                 "autotune/<ab>/<file>.best_config": Triton autotune result, ...}

The signature covers the header, and the header holds every artifact's SHA-256, so
one HMAC authenticates everything. :func:`read_bundle` checks all of it, and the
environment, before anything is written; :func:`install_bundle` then writes the
kernels into the local cache dir (temp file + rename, existing files left alone) and
hands the Mega-Cache bytes to ``torch.compiler.load_cache_artifacts``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import msgpack

from coordinator import _compat
from coordinator.errors import ConfigError, EnvironmentMismatch, IntegrityError
from coordinator.features.artifacts import AUTOTUNE_SUFFIXES, KERNEL_SUFFIXES, emit_kernels
from coordinator.protocol.fingerprint import (
    describe_difference,
    environment,
    fingerprint,
    key_prefix,
    secret_fingerprint,
)
from coordinator.protocol.node import file_lock
from coordinator.settings import Config, check_bundle_name

log = logging.getLogger(__name__)

#: ``outbox`` as a bundle URL: this node's outbox, ``<Inductor cache dir>/coordinator-outbox``,
#: a ``file://`` store that the SLURM Epilog publishes from (``coordinator.jobs.slurm``).
OUTBOX = "coordinator-outbox"
MAGIC = b"coordinator-bundle/1"
FORMAT = 1
_KERNEL = "kernel/"
_AUTOTUNE = "autotune/"
#: Broadcast in pieces of this size, so multi-GB bundles need bounded host and device memory.
BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024
_PROCESS_SEEN = time.time()


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A verified bundle: its header and artifacts."""

    header: dict
    artifacts: dict[str, bytes]
    signed: bool

    @property
    def megacache(self) -> bytes:
        return self.artifacts.get("megacache", b"")

    @property
    def kernels(self) -> dict[str, bytes]:
        return {name[len(_KERNEL):]: data for name, data in self.artifacts.items() if name.startswith(_KERNEL)}

    @property
    def autotune(self) -> dict[str, bytes]:
        return {name[len(_AUTOTUNE):]: data for name, data in self.artifacts.items() if name.startswith(_AUTOTUNE)}

    @property
    def compile_time_s(self) -> float:
        return float(self.header.get("compile_time_s", 0.0))

    def describe(self) -> dict:
        """What ``coordinator bundle inspect`` prints."""
        sizes: dict[str, int] = {}
        for name, data in self.artifacts.items():
            kind = name.split("/", 1)[0]
            sizes[kind] = sizes.get(kind, 0) + len(data)
        return {
            "fingerprint": fingerprint(self.header["environment"]),
            "environment": self.header["environment"],
            "created": self.header["created"],
            "compile_time_s": self.compile_time_s,
            "bytes_by_kind": sizes,
            "kernels": sorted(self.kernels),
            "signature": "HMAC-SHA256, verified" if self.signed else "unsigned (checksums only)",
        }


def build_bundle(
    artifacts: dict[str, bytes], *, compile_time_s: float = 0.0, secret: bytes | None = None,
    env: dict[str, str] | None = None,
) -> bytes:
    """Seal ``artifacts`` (``megacache``, ``kernel/<path>``, ``autotune/<path>``) into bundle bytes."""
    for name in artifacts:
        kernel = name.startswith(_KERNEL) and name.endswith(KERNEL_SUFFIXES)
        autotune = name.startswith(_AUTOTUNE) and name.endswith(AUTOTUNE_SUFFIXES)
        if name != "megacache" and not (kernel or autotune):
            raise ConfigError(f"unknown bundle artifact {name!r}")
    header = {
        "format": FORMAT,
        "environment": env or environment(),
        "created": {
            "host": socket.gethostname(),
            "time": time.time(),
            "job": os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "",
            "rank": int(os.environ.get("RANK", "0")),
        },
        "compile_time_s": compile_time_s,
        "artifacts": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for name, data in artifacts.items()
        },
    }
    header_bytes = msgpack.packb(header, use_bin_type=True)
    mac = hmac.new(secret, header_bytes, hashlib.sha256).digest() if secret else None
    return msgpack.packb([MAGIC, header_bytes, artifacts, mac], use_bin_type=True)


def pack_bundle(*, secret: bytes | None = None) -> bytes:
    """Bundle what this process compiled or received.

    The Mega-Cache artifacts of this process's compiles, plus what Mega-Cache leaves
    out: the compiled CPU kernels that ``compile_once`` shipped or received (or,
    without a session, every kernel file written to the cache dir since the
    coordinator was imported), and the Triton autotune ``.best_config`` files written
    since then.
    """
    import torch

    from coordinator.features.artifacts import collect_kernels
    from coordinator.session import current as current_session

    saved = torch.compiler.save_cache_artifacts()
    artifacts: dict[str, bytes] = {"megacache": saved[0] if saved else b""}
    cache_dir = _compat.inductor_cache_dir()
    session = current_session()
    if session is not None and session.kernels.files:
        names = session.kernels.files
    else:
        names = set(collect_kernels(cache_dir, _PROCESS_SEEN))
    # What a receiver saves: this process's own compile time, or, where it received
    # graphs through compile_once, what they cost the ranks that compiled them.
    compile_time = _compat.process_compile_seconds()
    if session is not None:
        compile_time = max(compile_time, session.kernels.compile_time_s)
    for rel in sorted(names):
        try:
            with open(os.path.join(cache_dir, rel), "rb") as f:
                artifacts[_KERNEL + rel] = f.read()
        except FileNotFoundError:
            log.warning("kernel %s vanished from the cache dir; leaving it out of the bundle", rel)
    for rel, data in collect_kernels(cache_dir, _PROCESS_SEEN, AUTOTUNE_SUFFIXES).items():
        artifacts[_AUTOTUNE + rel] = data
    return build_bundle(artifacts, compile_time_s=compile_time, secret=secret)


def read_bundle(blob: bytes, *, secret: bytes | None = None, check_environment: bool = True) -> Bundle:
    """Verify ``blob`` completely and return it; nothing is written.

    Raises:
        IntegrityError: not a bundle, truncated, checksum or signature failure.
        EnvironmentMismatch: built where torch/Triton/CUDA/GPU/Python differ (the
            message names each differing field).
    """
    try:
        outer = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise IntegrityError(f"not a coordinator bundle ({type(exc).__name__}: {exc})") from None
    if not (isinstance(outer, list) and len(outer) == 4 and outer[0] == MAGIC):
        raise IntegrityError("not a coordinator bundle (bad magic or layout)")
    _, header_bytes, artifacts, mac = outer
    if secret:
        if mac is None:
            raise IntegrityError("bundle is unsigned but a secret is configured")
        if not hmac.compare_digest(hmac.new(secret, header_bytes, hashlib.sha256).digest(), mac):
            raise IntegrityError("bundle HMAC signature mismatch: wrong secret or forged bundle")
    header = msgpack.unpackb(header_bytes, raw=False)
    if header.get("format") != FORMAT:
        raise IntegrityError(f"bundle format {header.get('format')} is not {FORMAT}")
    if check_environment and fingerprint(header["environment"]) != fingerprint():
        raise EnvironmentMismatch(
            "bundle was built in another environment: " + describe_difference(environment(), header["environment"])
        )
    listed = header["artifacts"]
    if set(listed) != set(artifacts):
        raise IntegrityError(f"bundle artifacts {sorted(set(listed) ^ set(artifacts))} do not match its header")
    for name, data in artifacts.items():
        if len(data) != listed[name]["size"] or hashlib.sha256(data).hexdigest() != listed[name]["sha256"]:
            raise IntegrityError(f"checksum mismatch in bundle artifact {name!r}")
    return Bundle(header, artifacts, signed=mac is not None)


def install_bundle(bundle: Bundle) -> dict:
    """Write a verified bundle into the local caches; extend NCCL timeouts.

    Returns:
        ``{"files_written", "megacache_bytes", "compile_time_s", "timeout_extension_s"}``.
    """
    import torch

    cache_dir = _compat.inductor_cache_dir()
    written = emit_kernels(cache_dir, bundle.kernels)
    written += emit_kernels(cache_dir, bundle.autotune, AUTOTUNE_SUFFIXES)
    if bundle.megacache:
        torch.compiler.load_cache_artifacts(bundle.megacache)
    extension = _compat.extend_nccl_timeouts(bundle.compile_time_s)
    return {
        "files_written": written,
        "megacache_bytes": len(bundle.megacache),
        "compile_time_s": bundle.compile_time_s,
        "timeout_extension_s": extension,
    }


def bundle_settings(secret: str | bytes | None = None, namespace: str | None = None) -> tuple[bytes | None, str]:
    """The secret and namespace a bundle is signed and keyed with: the arguments, else
    those of this process's ``compile_once`` (active, or the last to exit), else their
    environment variables, else none.

    Raises:
        ConfigError: a setting is invalid.
    """
    from coordinator.session import current as current_session

    session = current_session()
    config = session.config if session is not None else Config.resolve()
    config = config.replace(secret=secret, namespace=namespace)
    return config.secret, config.namespace


def bundle_url(url: str) -> str:
    """``url``, or for ``outbox`` the ``file://`` URL of this node's outbox in Inductor's
    cache dir (``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default), found when called."""
    if url == "outbox":
        return "file://" + os.path.join(_compat.inductor_cache_dir(), OUTBOX)
    return url


def bundle_key(name: str = "default", namespace: str | None = None, secret: str | bytes | None = None) -> str:
    """The store key of bundle ``name`` for this environment, secret and namespace (see
    :func:`bundle_settings`): ``bundles/<environment>/<secret>/<namespace>/<name>``, as
    ``coordinator.protocol.fingerprint.key_prefix`` names them.

    Raises:
        ConfigError: ``name`` cannot name a bundle.
    """
    check_bundle_name(name)
    secret, namespace = bundle_settings(secret, namespace)
    return f"bundles/{key_prefix(secret, namespace)}/{name}"


def broadcast_bundle(src: int = 0, group: Any = None, *, secret: str | bytes | None = None) -> dict:
    """Send rank ``src``'s bundle to every rank of ``group`` and install it there.

    Call it on all ranks at one point (after step 1, or after a warm-up). The bytes go
    over the process group: a CUDA uint8 tensor under NCCL, a CPU one under gloo, in
    chunks of ``BROADCAST_CHUNK_BYTES``.

    Returns:
        On ``src``: ``{"bytes"}``; elsewhere also what :func:`install_bundle` returns.
    """
    import torch.distributed as dist

    secret = bundle_settings(secret)[0]
    blob = pack_bundle(secret=secret) if dist.get_rank() == src else None
    received, elapsed = broadcast_bytes(blob, src, group)
    result: dict = {"bytes": len(received if received is not None else blob), "broadcast_s": elapsed}
    if received is not None:
        result.update(install_bundle(read_bundle(received, secret=secret)))
        log.info("received a %.1f MB bundle from rank %d in %.2fs", len(received) / 1e6, src, elapsed)
    return result


def broadcast_bytes(blob: bytes | None, src: int = 0, group: Any = None) -> tuple[bytes | bytearray | None, float]:
    """Broadcast ``blob`` from rank ``src``; returns (bytes received or None on src, seconds).

    Under NCCL the bytes travel as CUDA uint8 tensors, in chunks of
    ``BROADCAST_CHUNK_BYTES`` so device memory stays bounded; under gloo as CPU tensors.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = torch.tensor([len(blob) if rank == src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    total = int(size.item())
    start = time.perf_counter()
    if total == 0:
        return (b"" if rank != src else None), 0.0
    if not cuda:
        # gloo broadcasts CPU tensors in place; it may write into what it sends: copy.
        if rank == src:
            host = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        else:
            host = torch.empty(total, dtype=torch.uint8)
        for offset in range(0, total, BROADCAST_CHUNK_BYTES):
            dist.broadcast(host[offset : offset + BROADCAST_CHUNK_BYTES], src, group=group)
        return (host.numpy().tobytes() if rank != src else None), time.perf_counter() - start

    # NCCL: host bytes -> pinned staging chunk -> device chunk -> broadcast -> pinned -> host.
    # One chunk-sized pinned buffer and one device buffer, reused: memory stays bounded.
    import numpy as np

    chunk_bytes = min(BROADCAST_CHUNK_BYTES, max(total, 1))
    staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    received = bytearray(total) if rank != src else None
    source = np.frombuffer(blob, dtype=np.uint8) if rank == src else None
    target = np.frombuffer(received, dtype=np.uint8) if received is not None else None
    for offset in range(0, total, chunk_bytes):
        n = min(chunk_bytes, total - offset)
        if rank == src:
            staging.numpy()[:n] = source[offset : offset + n]
            on_device[:n].copy_(staging[:n], non_blocking=True)
        dist.broadcast(on_device[:n], src, group=group)
        if rank != src:
            staging[:n].copy_(on_device[:n], non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            target[offset : offset + n] = staging.numpy()[:n]
        else:
            torch.cuda.current_stream(device).synchronize()
    return received, time.perf_counter() - start


def save_bundle(
    url: str, *, name: str = "default", secret: str | bytes | None = None, ttl: timedelta | None = None,
    max_bytes: int | None = None, blob: bytes | None = None,
) -> int:
    """Persist this process's bundle (or ``blob``) under ``name`` in a store (``url``, or
    ``outbox``: this node's outbox, see :func:`bundle_url`).

    Readers never see a half-written bundle (the store publishes atomically). ``ttl``
    expires it in Redis; ``max_bytes`` refuses larger bundles.

    Returns:
        The bundle's size in bytes.
    """
    from coordinator.protocol.stores import open_store

    blob = pack_bundle(secret=bundle_settings(secret)[0]) if blob is None else blob
    if max_bytes is not None and len(blob) > max_bytes:
        raise ConfigError(f"max_bytes={max_bytes}: the bundle is {len(blob)} bytes, over this limit")
    store = open_store(bundle_url(url))
    store.set(bundle_key(name, secret=secret), blob, ttl=ttl)
    log.info("saved a %.1f MB bundle as %s in %s", len(blob) / 1e6, name, store.name)
    return len(blob)


def fetch_bundle(url: str, *, name: str = "default", secret: str | bytes | None = None) -> Bundle:
    """Read and verify bundle ``name`` from a store; nothing is written.

    Raises:
        FileNotFoundError: there is no such bundle for this environment.
    """
    from coordinator.protocol.stores import open_store

    store = open_store(url)
    blob = store.get(bundle_key(name, secret=secret))
    if blob is None:
        raise FileNotFoundError(f"no bundle {name!r} for environment {fingerprint()} in {store.name}")
    return read_bundle(blob, secret=bundle_settings(secret)[0])


def copy_bundles(src_url: str, dst_url: str, *, secret: str | bytes | None = None, move: bool = True) -> list[str]:
    """Publish every bundle of store ``src_url`` to ``dst_url`` under the same key.

    Each is verified first (checksums, signature, and that its environment is the one
    its key names); one that fails is left out with a warning. With ``move`` the
    source copy is deleted once published.

    Returns:
        The keys published.
    """
    from coordinator.protocol.stores import open_store

    src, dst = open_store(src_url), open_store(dst_url)
    published = []
    for key in src.list_keys("bundles/"):
        blob = src.get(key)
        if blob is None:
            continue
        try:
            verify_with = bundle_settings(secret)[0]
            bundle = read_bundle(blob, secret=verify_with, check_environment=False)
            if key.split("/")[1] != fingerprint(bundle.header["environment"]):
                raise EnvironmentMismatch(f"its environment is not the one its key {key} names")
            if verify_with and key.split("/")[2] != secret_fingerprint(verify_with):
                raise IntegrityError(f"its key {key} names another secret than the one it was verified with")
        except IntegrityError as exc:
            log.warning("not publishing %s from %s: %s", key, src.name, exc)
            continue
        dst.set(key, blob)
        published.append(key)
        if move:
            src.delete(key)
    return published


def load_bundle(url: str, *, name: str = "default", secret: str | bytes | None = None) -> dict:
    """Fetch, verify and install bundle ``name``, once per node.

    The first process on a node to get the node-local lock (in the Inductor cache dir)
    fetches and installs; the others wait on the lock and find the bundle installed.

    Returns:
        ``{"fetched": bool, ...}`` with :func:`install_bundle`'s figures when fetched.
    """
    cache_dir = _compat.inductor_cache_dir()
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""
    tag = hashlib.sha256(f"{url}\0{bundle_key(name, secret=secret)}\0{job}".encode()).hexdigest()[:16]
    marker = os.path.join(cache_dir, f".coordinator-bundle-{tag}.done")
    with file_lock(os.path.join(cache_dir, ".coordinator-bundle.lock"), None):
        if os.path.exists(marker):
            return {"fetched": False}
        result = install_bundle(fetch_bundle(url, name=name, secret=secret))
        with open(marker, "w") as f:
            f.write(str(time.time()))
        return {"fetched": True, **result}
