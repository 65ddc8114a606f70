"""Bundles in stores: save one, fetch one, publish every bundle of one store to another."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from coordinator.bundles.format import Bundle, KernelRecord, pack_bundle, read_bundle
from coordinator.bundles.keys import OUTBOX, bundle_key, bundle_settings, bundle_url, session_parts
from coordinator.errors import ConfigError, EnvironmentMismatch, IntegrityError, StoreFull
from coordinator.protocol.fingerprint import fingerprint, secret_fingerprint
from coordinator.settings import Config

__all__ = ["OUTBOX", "copy_bundles", "fetch_bundle", "save_bundle"]

log = logging.getLogger(__name__)


def save_bundle(
    url: str, *, name: str = "default", secret: str | bytes | None = None, ttl: timedelta | None = None,
    max_bytes: int | None = None, blob: bytes | None = None, config: Config | None = None,
    kernels: KernelRecord | None = None,
) -> int:
    """Persist this process's bundle (or ``blob``) under ``name`` in a store (``url``: a
    ``redis://``, ``file://``, ``s3://``, ``gs://`` or ``az://`` URL, or ``outbox``: this
    node's outbox, see :func:`~coordinator.bundles.keys.bundle_url`).

    ``config`` gives the secret and namespace and ``kernels`` the kernels to carry (a
    session's; neither given: the session :mod:`coordinator.bundles.keys` finds).
    Readers never see a half-written bundle (the store publishes atomically; an object
    store uploads a large one in parts, one part in memory besides the bundle). ``ttl``
    (positive) expires it in Redis; ``max_bytes`` refuses larger bundles, and so does a
    store that cannot hold it (Redis's ``maxmemory``).

    Returns:
        The bundle's size in bytes.

    Raises:
        ConfigError: ``ttl`` is not positive, or the bundle is over ``max_bytes``.
        StoreFull: the bundle is larger than the store can hold, or the store refused it.
    """
    from coordinator.protocol.stores import open_store, shown_url
    from coordinator.protocol.stores.base import ttl_ms

    ttl_ms(ttl)  # refuses a TTL that is not positive, before any work
    config, kernels = session_parts(config, kernels)
    if blob is None:
        blob = pack_bundle(secret=bundle_settings(secret, config=config)[0], kernels=kernels)
    if max_bytes is not None and len(blob) > max_bytes:
        raise ConfigError(f"max_bytes={max_bytes}: the bundle is {len(blob)} bytes, over this limit")
    store = open_store(bundle_url(url))
    limit = store.capacity()
    if limit is not None and len(blob) > limit:
        raise StoreFull(f"the bundle is {len(blob)} bytes; {store.name} holds at most {limit} "
                        "(its maxmemory less the server's own use)")
    started = time.monotonic()
    store.set(bundle_key(name, secret=secret, config=config), blob, ttl=ttl)
    where = shown_url(url) if url == bundle_url(url) else f"{url} ({bundle_url(url)})"
    log.info("saved a %.1f MB bundle as %r in %s in %.2fs", len(blob) / 1e6, name, where, time.monotonic() - started)
    return len(blob)


def fetch_bundle(url: str, *, name: str = "default", secret: str | bytes | None = None,
                 config: Config | None = None) -> Bundle:
    """Read and verify bundle ``name`` from a store; nothing is written.

    Raises:
        FileNotFoundError: there is no such bundle for this environment.
    """
    from coordinator.protocol.stores import open_store, shown_url

    store = open_store(url)
    key = bundle_key(name, secret=secret, config=config)
    blob = store.get(key)
    if blob is None:
        raise missing_bundle(store, key, name, shown_url(url))
    return read_bundle(blob, secret=bundle_settings(secret, config=config)[0])


def missing_bundle(store: Any, key: str, name: str, shown: str) -> Exception:
    """The error for bundle ``key`` not found in ``store``: an ``IntegrityError`` where the
    bundle is there under another secret (a wrong secret, or none set), else ``FileNotFoundError``."""
    environment, mine, namespace = key.split("/")[1:4]
    try:
        others = [other for other in store.list_keys(f"bundles/{environment}/")
                  if other.split("/")[3:] == [namespace, name] and other.split("/")[2] != mine]
    except Exception:  # a store that cannot list: say what was asked
        others = []
    if others:
        given = "no secret is set" if mine == "none" else "the secret given is not the one it was written with"
        return IntegrityError(f"bundle {name!r} for environment {environment} in {shown} is there under another "
                              f"secret, but {given}: set COORDINATOR_SECRET to the secret that wrote it")
    return FileNotFoundError(f"no bundle {name!r} for environment {environment} in {shown}")


def copy_bundles(src_url: str, dst_url: str, *, secret: str | bytes | None = None, move: bool = True,
                 config: Config | None = None, refused: dict[str, str] | None = None) -> list[str]:
    """Publish every bundle of store ``src_url`` to ``dst_url`` under the same key.

    Each is verified first (checksums, signature, and that its environment is the one
    its key names); one that fails is left out with a warning, and named with the reason
    in ``refused`` if given. With ``move`` the source copy is deleted once published.

    Returns:
        The keys published.
    """
    from coordinator.protocol.stores import open_store, shown_url

    src, dst = open_store(src_url), open_store(dst_url)
    published = []
    for key in src.list_keys("bundles/"):
        blob = src.get(key)
        if blob is None:
            continue
        try:
            verify_with = bundle_settings(secret, config=config)[0]
            bundle = read_bundle(blob, secret=verify_with, check_environment=False)
            if key.split("/")[1] != fingerprint(bundle.header["environment"]):
                raise EnvironmentMismatch(f"its environment is not the one its key {key} names")
            if verify_with and key.split("/")[2] != secret_fingerprint(verify_with):
                raise IntegrityError(f"its key {key} names another secret than the one it was verified with")
        except IntegrityError as exc:
            log.warning("not publishing %s from %s: %s", key, shown_url(src_url), exc)
            if refused is not None:
                refused[key] = str(exc)
            continue
        dst.set(key, blob)
        published.append(key)
        if move:
            src.delete(key)
    return published
