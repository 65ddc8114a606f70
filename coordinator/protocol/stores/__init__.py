"""Stores: where ranks meet. One interface, implementations chosen in one place.

:func:`open_store` turns a setting into a :class:`Store`: ``None`` means the job's
torch.distributed store, a URL picks Redis, a directory or an object store (S3, GCS,
Azure: bundles and the persistent layer, never live claims), and a store object is
wrapped or passed through. Backends with optional dependencies are imported only
when chosen. A store's URL is shown in messages as :func:`shown_url` shows it (defined
beside ``check_store_url`` in ``coordinator.settings``, which the settings' errors use too).
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import unquote, urlparse

from coordinator.errors import ConfigError, StoreError
from coordinator.protocol.stores.base import Store
from coordinator.settings import OBJECT_SCHEMES, STORE_SCHEMES, check_store_url, shown_url

__all__ = ["Store", "check_store_url", "open_store", "shown_url"]


def _open_redis(url: str, chunk_bytes: int) -> Store:
    from coordinator.protocol.stores.redis import RedisStore

    return RedisStore(url, chunk_bytes=chunk_bytes)


def _open_file(url: str, chunk_bytes: int) -> Store:
    from coordinator.protocol.stores.file import FileStore

    return FileStore(unquote(urlparse(url).path))


#: The object stores this process opened, by URL (see ``coordinator.protocol.stores.objects``).
_object_stores: dict[str, Store] = {}
_object_stores_lock = threading.Lock()


def _open_objects(url: str, chunk_bytes: int) -> Store:
    from coordinator.protocol.stores.objects import ObjectStore

    with _object_stores_lock:
        if url not in _object_stores:
            _object_stores[url] = ObjectStore(url)
        return _object_stores[url]


#: How each URL scheme of ``settings.STORE_SCHEMES`` is opened.
_URL_SCHEMES = {"redis": _open_redis, "rediss": _open_redis, "file": _open_file,
                **dict.fromkeys(OBJECT_SCHEMES, _open_objects)}
assert sorted(_URL_SCHEMES) == sorted(STORE_SCHEMES)


def open_store(spec: Any = None, *, chunk_bytes: int = 64 * 1024 * 1024) -> Store:
    """Open the store named by ``spec``.

    Args:
        spec: ``None`` (the default process group's store), a URL (``redis://``,
            ``rediss://``, ``file://``; ``s3://``, ``gs://``, ``az://`` for bundles and the
            persistent layer), a ``torch.distributed.Store`` or a ``Store``.
        chunk_bytes: largest single Redis value.

    Raises:
        ConfigError: the URL cannot name a store (see :func:`check_store_url`).
        StoreError: ``spec`` is ``None`` and no default process group is initialized.
    """
    if isinstance(spec, Store):
        return spec
    if isinstance(spec, str):
        check_store_url(spec)
        return _URL_SCHEMES[urlparse(spec).scheme](spec, chunk_bytes)

    from coordinator.protocol.stores.c10d import C10dStore

    if spec is None:
        from coordinator import _compat

        default = _compat.default_c10d_store()
        if default is None:
            raise StoreError("no store given and torch.distributed is not initialized")
        return C10dStore(default)
    import torch.distributed as dist

    if isinstance(spec, dist.Store):
        return C10dStore(spec)
    raise ConfigError(f"cannot use {type(spec).__name__} as a store")
