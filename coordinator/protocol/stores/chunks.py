"""The value layout shared by stores that cap a single value's size (Redis, TCPStore).

A stored value starts with a one-byte tag. ``R`` + the value itself, when it fits in one
store value; otherwise ``M`` + a msgpack manifest ``{"id", "n", "size"}`` naming ``n``
chunks written under an upload id *before* the manifest, so a reader that sees the
manifest finds every chunk (or, if the key was replaced meanwhile, a missing chunk, which
reads as absent), never half a value.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import msgpack

from coordinator.errors import StoreError

RAW = b"R"
MANIFEST = b"M"


def split(value: bytes, chunk_bytes: int) -> tuple[bytes, str, list[bytes]]:
    """What to store for ``value``: the tagged head, and (if chunked) the upload id and chunks."""
    if len(value) + 1 <= chunk_bytes:
        return RAW + value, "", []
    upload_id = uuid.uuid4().hex[:16]
    chunks = [value[start : start + chunk_bytes] for start in range(0, len(value), chunk_bytes)]
    return MANIFEST + msgpack.packb({"id": upload_id, "n": len(chunks), "size": len(value)}), upload_id, chunks


def chunk_names(head: bytes | None) -> tuple[str, int]:
    """The upload id and chunk count a stored head names; ``("", 0)`` for a plain value."""
    if not head or head[:1] != MANIFEST:
        return "", 0
    manifest = msgpack.unpackb(head[1:])
    return manifest["id"], manifest["n"]


def join(key: str, head: bytes, read_chunks: Callable[[str, int], list[bytes | None]]) -> bytes | None:
    """The value a stored head stands for; ``read_chunks(upload_id, n)`` fetches chunks."""
    tag, body = head[:1], head[1:]
    if tag == RAW:
        return body
    if tag != MANIFEST:
        raise StoreError(f"stored value of {key} has an unknown layout tag {tag!r}")
    manifest = msgpack.unpackb(body)
    parts = read_chunks(manifest["id"], manifest["n"])
    if any(part is None for part in parts):  # replaced meanwhile, expired or evicted
        return None
    value = b"".join(parts)
    return value if len(value) == manifest["size"] else None
