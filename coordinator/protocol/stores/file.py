"""A directory on a shared filesystem as a coordinator store (``file:///path``).

Each key is a file below the root. Writes go to a temporary file in the same
directory and are published with ``os.replace``, so a reader sees either nothing or
the whole value — never a torn write, which is what breaks shared Inductor cache
directories under many ranks. A claim is published with ``os.link``, which fails
if the target exists: atomic create-if-absent with the full content in place.
Expiry is not supported; stale claims are detected by their heartbeat instead. A write
refused for lack of room (``ENOSPC``, ``EDQUOT``) is
:class:`~coordinator.errors.StoreFull`, and leaves no temporary file behind.
"""

from __future__ import annotations

import errno
import os
import uuid
from datetime import timedelta

from coordinator.errors import StoreError, StoreFull
from coordinator.protocol.stores.base import Store, StoredEntry, check_key


class FileStore(Store):
    """Keys as files under ``root``; safe for many writers on one host or over NFS."""

    name = "file"

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _temp_file(self, path: str, value: bytes) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return tmp

    def _error(self, doing: str, exc: OSError) -> StoreError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(f"{doing} {self.root} refused: {exc}")
        return StoreError(f"{doing} {self.root} failed: {exc}")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"reading {key} from {self.root} failed: {exc}") from exc

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        path = self._path(key)
        try:
            tmp = self._temp_file(path, value)
            os.replace(tmp, path)
        except OSError as exc:
            raise self._error(f"writing {key} to", exc) from exc

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        path = self._path(key)
        try:
            tmp = self._temp_file(path, value)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise self._error(f"claiming {key} in", exc) from exc

    def list_keys(self, prefix: str) -> list[str]:
        keys = []
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if ".tmp-" in name:
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_entries(self, prefix: str) -> list[StoredEntry]:
        entries = []
        for key in self.list_keys(prefix):
            try:
                st = os.stat(self._path(key))
            except FileNotFoundError:
                continue
            entries.append(StoredEntry(key, st.st_size, st.st_mtime))
        return entries

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"deleting {key} from {self.root} failed: {exc}") from exc
