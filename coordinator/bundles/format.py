"""The bundle format: what a bundle holds, how it is packed, sealed and read back.

A bundle is one value sealed as :mod:`coordinator.protocol.integrity` seals every value
(checksum, HMAC-SHA256 with the secret when one is set), under the fixed key
:data:`SEALED_AS`. Its metadata is the header, its files the artifacts::

    meta  = {"format", "environment", "created", "compile_time_s",
             "artifacts": {name: {"sha256", "size"}}}
    files = {"megacache": torch.compiler.save_cache_artifacts() bytes,
             "kernel/<ab>/<file>.so": compiled CPU kernel, ...,
             "autotune/<ab>/<file>.best_config": Triton autotune result, ...,
             "triton/<hash>/<file>": a Triton cache entry outside Inductor (a kernel, an
                                     autotuner's timings), ...}

:func:`read_bundle` checks all of it (the seal, the format, the environment, each
artifact against the header) before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
from typing import Protocol

from coordinator import _compat
from coordinator.errors import ConfigError, EnvironmentMismatch, IntegrityError
from coordinator.features.artifacts import AUTOTUNE_SUFFIXES, KERNEL_SUFFIXES, TRITON_PREFIX, triton_entry_file
from coordinator.protocol.fingerprint import describe_difference, environment, fingerprint
from coordinator.protocol.integrity import open_sealed, seal

log = logging.getLogger(__name__)

FORMAT = 1
#: The key every bundle is sealed for: a bundle is stored under many keys (and in files),
#: and the seal binds it to being a bundle, not to one of them.
SEALED_AS = "coordinator-bundle"
KERNEL = "kernel/"
AUTOTUNE = "autotune/"
#: Without a session's record of kernels, a bundle carries the kernel files written since
#: the coordinator was imported.
_PROCESS_SEEN = time.time()


class KernelRecord(Protocol):
    """What a session knows of the kernels it compiled or received
    (``coordinator.features.artifacts.ShippedKernels``)."""

    files: set[str]
    compile_time_s: float

    def read_triton(self) -> dict[str, bytes]:
        """The Triton cache entries outside Inductor it compiled or received (``triton/<hash>/<file>``)."""


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A verified bundle: its header and artifacts."""

    header: dict
    artifacts: dict[str, bytes]
    #: It carries a signature, checked or not.
    signed: bool
    #: Its signature was checked against the secret it was read with, and matched.
    verified: bool = False

    @property
    def megacache(self) -> bytes:
        return self.artifacts.get("megacache", b"")

    @property
    def kernels(self) -> dict[str, bytes]:
        return {name[len(KERNEL):]: data for name, data in self.artifacts.items() if name.startswith(KERNEL)}

    @property
    def autotune(self) -> dict[str, bytes]:
        return {name[len(AUTOTUNE):]: data for name, data in self.artifacts.items() if name.startswith(AUTOTUNE)}

    @property
    def triton(self) -> dict[str, bytes]:
        """Triton cache entries outside Inductor, by ``triton/<hash>/<file>``."""
        return {name: data for name, data in self.artifacts.items() if name.startswith(TRITON_PREFIX)}

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
            "signature": _signature(self.signed, self.verified),
        }


def build_bundle(
    artifacts: dict[str, bytes], *, compile_time_s: float = 0.0, secret: bytes | None = None,
    env: dict[str, str] | None = None,
) -> bytes:
    """Seal ``artifacts`` (``megacache``, ``kernel/<path>``, ``autotune/<path>``, ``triton/<hash>/<file>``)
    into bundle bytes."""
    for name in artifacts:
        kernel = name.startswith(KERNEL) and name.endswith(KERNEL_SUFFIXES)
        autotune = name.startswith(AUTOTUNE) and name.endswith(AUTOTUNE_SUFFIXES)
        if name != "megacache" and not (kernel or autotune or triton_entry_file(name)):
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
    return seal(SEALED_AS, b"", meta=header, files=artifacts, secret=secret)


def pack_bundle(*, secret: bytes | None = None, kernels: KernelRecord | None = None) -> bytes:
    """Bundle what this process compiled or received.

    The Mega-Cache artifacts of this process's compiles, plus what Mega-Cache leaves
    out: the compiled CPU kernels of ``kernels`` (a session's record of those it shipped
    or received; without one, or an empty one, every kernel file written to the cache
    dir since the coordinator was imported), the Triton autotune ``.best_config``
    files written since then, and the Triton cache entries outside Inductor (kernels,
    autotuners' timings) the session compiled or received.
    """
    import torch

    from coordinator.features.artifacts import collect_kernels

    saved = torch.compiler.save_cache_artifacts()
    artifacts: dict[str, bytes] = {"megacache": saved[0] if saved else b""}
    cache_dir = _compat.inductor_cache_dir()
    names = kernels.files if kernels is not None and kernels.files else set(collect_kernels(cache_dir, _PROCESS_SEEN))
    # What a receiver saves: this process's own compile time, or, where it received
    # graphs through compile_once, what they cost the ranks that compiled them.
    compile_time = _compat.process_compile_seconds()
    if kernels is not None:
        compile_time = max(compile_time, kernels.compile_time_s)
    for rel in sorted(names):
        try:
            with open(os.path.join(cache_dir, rel), "rb") as f:
                artifacts[KERNEL + rel] = f.read()
        except FileNotFoundError:
            log.warning("kernel %s vanished from the cache dir; leaving it out of the bundle", rel)
    for rel, data in collect_kernels(cache_dir, _PROCESS_SEEN, AUTOTUNE_SUFFIXES).items():
        artifacts[AUTOTUNE + rel] = data
    if kernels is not None and hasattr(kernels, "read_triton"):
        artifacts.update(kernels.read_triton())
    return build_bundle(artifacts, compile_time_s=compile_time, secret=secret)


def read_bundle(blob: bytes, *, secret: bytes | None = None, check_environment: bool = True) -> Bundle:
    """Verify ``blob`` completely and return it; nothing is written.

    Raises:
        IntegrityError: not a bundle, truncated, checksum or signature failure.
        EnvironmentMismatch: built where torch/Triton/CUDA/GPU/Python differ (the
            message names each differing field).
    """
    sealed = open_sealed(SEALED_AS, blob, secret=secret, what="bundle")
    header, artifacts = sealed.meta, sealed.files
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
    return Bundle(header, artifacts, signed=sealed.signed, verified=sealed.verified)


def _signature(signed: bool, verified: bool) -> str:
    """A bundle's signature as ``inspect`` says it: "verified" only once checked."""
    if verified:
        return "HMAC-SHA256, verified"
    if signed:
        return "HMAC-SHA256, not verified (no secret given: set COORDINATOR_SECRET to check it)"
    return "unsigned (checksums only)"
