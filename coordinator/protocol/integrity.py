"""Sealing values: checksum, optional HMAC signature, and binding to their key.

A compiled artifact is a pickle, and unpickling runs code, so nothing read from a
store reaches Inductor before it is verified. :func:`seal` wraps a payload in a
msgpack envelope::

    [MAGIC, body, sha256(body), hmac_sha256(secret, body) | nil]
    body = msgpack({"key": store key, "payload": bytes, "meta": {...}, "files": {...}})

:func:`open_sealed` checks the magic, the checksum, the signature (required when
a secret is configured) and that the value was sealed for this very key (so a valid
value cannot be replayed under another key), and only then unpacks the body. Any
failure raises :class:`~coordinator.errors.IntegrityError` with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import msgpack

from coordinator.errors import IntegrityError

MAGIC = b"coordinator/1"


@dataclasses.dataclass(frozen=True, slots=True)
class Sealed:
    """What a verified envelope holds."""

    payload: bytes
    meta: dict
    files: dict[str, bytes]
    #: It carries a signature (a MAC), checked or not.
    signed: bool
    #: Its signature was checked against a secret and matched.
    verified: bool = False


def seal(key: str, payload: bytes, *, meta: dict | None = None, files: dict[str, bytes] | None = None,
         secret: bytes | None = None) -> bytes:
    """Wrap ``payload`` (plus metadata and files) for storage under ``key``."""
    body = msgpack.packb(
        {"key": key, "payload": payload, "meta": meta or {}, "files": files or {}},
        use_bin_type=True,
    )
    digest = hashlib.sha256(body).digest()
    mac = hmac.new(secret, body, hashlib.sha256).digest() if secret else None
    return msgpack.packb([MAGIC, body, digest, mac], use_bin_type=True)


def open_sealed(key: str, blob: bytes, *, secret: bytes | None = None, what: str = "value") -> Sealed:
    """Verify ``blob`` and return its contents. ``what`` names the sealed thing in errors
    (``"bundle"``: "not a coordinator bundle", "bundle is unsigned ...").

    Raises:
        IntegrityError: bad format, checksum mismatch, missing or wrong signature
            (when ``secret`` is set), or the value was sealed for another key.
    """
    envelope = "envelope" if what == "value" else what
    try:
        outer = msgpack.unpackb(blob, raw=False, use_list=True)
    except Exception as exc:  # truncated or not msgpack at all
        raise IntegrityError(f"not a coordinator {envelope} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(outer, list) and len(outer) == 4 and outer[0] == MAGIC):
        raise IntegrityError(f"not a coordinator {envelope} (bad magic or layout)")
    _, body, digest, mac = outer
    if not isinstance(body, bytes) or hashlib.sha256(body).digest() != digest:
        raise IntegrityError(f"checksum mismatch: the {what} was corrupted or truncated")
    if secret:
        if mac is None:
            raise IntegrityError(f"{what} is unsigned but a secret is configured")
        expected = hmac.new(secret, body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise IntegrityError(f"HMAC signature mismatch: wrong secret or forged {what}")
    fields = msgpack.unpackb(body, raw=False)
    if fields.get("key") != key:
        raise IntegrityError(f"{what} was sealed for key {fields.get('key')!r}, not {key!r}")
    return Sealed(fields["payload"], fields["meta"], fields["files"], signed=mac is not None, verified=bool(secret))
