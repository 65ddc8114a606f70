"""The fingerprints that namespace every key: the environment's and the secret's.

Compiled artifacts are only valid where they were built: the same torch and Triton,
the same CUDA, the same GPU model and compute capability, the same Python (pickles
and bytecode), the same CPU architecture for C++ kernels, and the same format of our
own envelope. Keys are prefixed with a short hash of these fields, so artifacts never
cross incompatible environments; the fields themselves are kept for error messages.

Values are signed with the job's secret, and a job refuses values signed with another
one. Keys are also prefixed with a short fingerprint of the secret (``none`` without
one), so jobs with different secrets on one store keep apart: neither reads the
other's values (and compiles each graph again after refusing them), nor overwrites them.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys

import msgpack

#: Version of the coordinator's key layout and value envelope.
FORMAT_VERSION = 1


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """The fields that decide whether an artifact can be used here."""
    import torch

    triton = _package_version("triton")
    if triton == "none":
        triton = _package_version("pytorch-triton")
    fields = {
        "format": str(FORMAT_VERSION),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", "unknown"),
        "triton": triton,
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "machine": platform.machine(),
        "gpu": "none",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        fields["gpu"] = f"{props.name} sm_{props.major}{props.minor}"
    return fields


def fingerprint(fields: dict[str, str] | None = None) -> str:
    """A 16-hex-digit hash of :func:`environment` (or of ``fields``)."""
    fields = environment() if fields is None else fields
    packed = msgpack.packb(sorted(fields.items()))
    return hashlib.sha256(packed).hexdigest()[:16]


def secret_fingerprint(secret: bytes | None) -> str:
    """12 hex digits of a SHA-256 over a domain-separated string of ``secret``, or ``none``.

    The secret itself is never in a key. The fingerprint tells a reader of the store no
    more than a signed value does: either lets one test guesses of the secret offline.
    """
    if not secret:
        return "none"
    return hashlib.sha256(b"coordinator/key-namespace/1\0" + secret).hexdigest()[:12]


def key_prefix(secret: bytes | None, namespace: str) -> str:
    """``<environment>/<secret>/<namespace or _>``: the prefix of every key a session or
    a bundle uses."""
    return f"{fingerprint()}/{secret_fingerprint(secret)}/{namespace or '_'}"


def describe_difference(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """Name the fields in which two environments differ, e.g. ``torch: 2.13.0 != 2.11.0``."""
    names = sorted(set(ours) | set(theirs))
    diffs = [f"{n}: {theirs.get(n)!s} != {ours.get(n)!s}" for n in names if ours.get(n) != theirs.get(n)]
    return "; ".join(diffs) if diffs else "no difference"
