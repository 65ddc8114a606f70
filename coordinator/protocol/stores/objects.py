"""Object stores (S3, GCS, Azure Blob) for bundles and the persistent layer.

``s3://bucket/prefix``, ``gs://bucket/prefix`` and ``az://container/prefix`` name a folder
of a bucket; each key is one object below it. They are reached through fsspec and its
providers (s3fs, gcsfs, adlfs), optional extras imported only when such a URL is opened.
Credentials come from each provider's own chain (environment variables, profiles, the
instance's role), never from the URL, and are never logged. An S3-compatible server
(MinIO, moto) is named by the standard AWS setting for it, ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (or ``endpoint_url`` in the profile), which botocore reads under s3fs.

**Not a live store.** A job's claims need an atomic create and signals that wake waiters;
an object store is a place for values that outlive the job. :meth:`ObjectStore.add_if_absent`
refuses with ``ConfigError``, and ``Config`` refuses an object URL as ``store``.

**Atomic writes.** A value is one object, written by one request or, above ``part_bytes``, by
a multipart upload through fsspec's buffered writer (one part in memory besides the value).
S3, GCS and Azure make an object visible only whole: on a single PUT, on the completion of
a multipart upload, on the finalization of a resumable upload, on the commit of a block
list. A reader sees the old object or the whole new one, and of two writers of one key
the later completion wins whole. So no pointer object is written after the data: a pointer
would cost every read a second request and leave orphans to collect, and it would add no
guarantee. What the store must not do is complete an upload that failed: fsspec's writer
completes on ``close``, which its context manager calls on an exception too, so a failed
upload here is discarded instead (the multipart upload is aborted, or its uncommitted blocks
are left to expire) and never closed. Reads of a large object pin its version (s3fs reads
with the ``ETag`` it first saw, ``If-Match``), and every value is sealed and verified by its
reader anyway (``coordinator.protocol.integrity``): a torn value can only be refused.

**One client per URL.** :func:`~coordinator.protocol.stores.open_store` keeps one
``ObjectStore`` per URL in a process, so that a store opened (and connected, :meth:`connect`)
while a job runs is the one its exit uses: a client's first request needs a thread, which a
process that is exiting cannot start.

**Progress.** A transfer longer than one part logs its progress every ``progress_interval``
and a last line with its rate.

**Bounded calls.** Each provider's client is made with the connect and answer timeouts and the
tries of ``bounds.OBJECT_STORES`` (:mod:`coordinator.protocol.stores.bounds`), so that a server
that is down, or that accepts connections and never answers, fails a call within about two
minutes (an upload that the server stops reading midway is not bounded: that module says why).

Every failure of the provider is a :class:`~coordinator.errors.StoreError` that names the URL
and, for a missing bucket or a refused request, what to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse

from coordinator.errors import ConfigError, StoreError
from coordinator.protocol.stores.base import Store, StoredEntry, check_key
from coordinator.protocol.stores.bounds import OBJECT_STORES, CallBounds
from coordinator.settings import OBJECT_SCHEMES, check_store_url, shown_url

log = logging.getLogger(__name__)

#: Size of one part of a multipart upload, and of one ranged read (S3's smallest part is 5 MiB).
PART_BYTES = 64 * 1024 * 1024
_MIN_PART_BYTES = 5 * 1024 * 1024

#: Where each provider takes its credentials from, for error messages.
_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the instance's role",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, or the instance's service account",
    "az": "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, "
          "or Azure's default credential chain",
}


def _filesystem(scheme: str, bounds: CallBounds) -> Any:
    """A provider's filesystem of our own (not fsspec's shared instance: our bounds are ours),
    with listings never cached (another job may have written since)."""
    try:
        return _PROVIDERS[scheme](bounds, skip_instance_cache=True, use_listings_cache=False)
    except ImportError as exc:
        module, extra = OBJECT_SCHEMES[scheme]
        raise ConfigError(f"{scheme}:// URLs need {module}: pip install \"torch-compile-coordinator[{extra}]\" "
                          f"({exc})") from None
    except Exception as exc:  # the provider's own set-up failed (a malformed profile, ...)
        raise StoreError(f"cannot set up the {scheme}:// client: {type(exc).__name__}: {exc}") from exc


def _s3(bounds: CallBounds, **options: Any) -> Any:
    """s3fs, with botocore's timeouts and tries (standard mode)."""
    import s3fs
    from aiobotocore.session import AioSession
    from botocore.handlers import add_expect_header

    session = AioSession()
    # botocore asks for "100 Continue" before an upload's body, and aiohttp waits for that with
    # no timeout: a server that accepts connections and never answers would hold every write.
    session.unregister("before-call.s3", add_expect_header)
    fs = s3fs.S3FileSystem(session=session, config_kwargs={
        "connect_timeout": bounds.connect.total_seconds(), "read_timeout": bounds.answer.total_seconds(),
        "retries": {"total_max_attempts": bounds.tries, "mode": "standard"}}, **options)
    fs.retries = 1  # s3fs's own tries of a call, around botocore's: one, or the two would multiply
    return fs


def _gcs(bounds: CallBounds, **options: Any) -> Any:
    """gcsfs's ``GCSFileSystem`` (the JSON API over aiohttp), with aiohttp's timeouts and gcsfs's
    tries. Not gcsfs's experimental extension for zonal and hierarchical buckets, which fsspec
    picks by default: it asks a gRPC control API about the bucket before a call, with a minute
    of tries of its own (and before every call where that API does not answer)."""
    import aiohttp
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import retry_request

    class BoundedGCSFileSystem(GCSFileSystem):
        # gcsfs tries a request 6 times, a number its decorator fixed when the class was made.
        _request = retry_request(retries=bounds.tries)(GCSFileSystem._request.__wrapped__)

    # A number would bound each request's whole transfer; these bound its connect and silences.
    timeout = aiohttp.ClientTimeout(sock_connect=bounds.connect.total_seconds(),
                                    sock_read=bounds.answer.total_seconds())
    return BoundedGCSFileSystem(requests_timeout=timeout, **options)


def _azure(bounds: CallBounds, **options: Any) -> Any:
    """adlfs, whose Azure client is made with our timeouts and tries (adlfs passes its own
    timeout options to its uploads and downloads only, not to its listings or deletes)."""
    from adlfs import AzureBlobFileSystem
    from azure.storage.blob.aio import LinearRetry

    half_pause = bounds.pause.total_seconds() / 2
    client_options = {
        "connection_timeout": bounds.connect.total_seconds(), "read_timeout": bounds.answer.total_seconds(),
        "retry_policy": LinearRetry(backoff=half_pause, random_jitter_range=half_pause,
                                    retry_total=bounds.tries - 1),
    }

    class BoundedAzureBlobFileSystem(AzureBlobFileSystem):
        def do_connect(self) -> None:
            super().do_connect()  # adlfs picks the account, its URL and the credential
            made = self.service_client
            if self.connection_string is not None:
                self.service_client = type(made).from_connection_string(self.connection_string, **client_options)
            else:
                credential = self.credential if self.credential is not None else self.account_key
                self.service_client = type(made)(made.url, credential=credential, **client_options)

    return BoundedAzureBlobFileSystem(**options)


#: How each provider's filesystem is made, by URL scheme.
_PROVIDERS: dict[str, Callable[..., Any]] = {"s3": _s3, "gs": _gcs, "az": _azure}
assert sorted(_PROVIDERS) == sorted(OBJECT_SCHEMES) == sorted(OBJECT_STORES)


class ObjectStore(Store):
    """Keys as objects below ``bucket/prefix`` of an object store, through fsspec."""

    live = False

    def __init__(self, url: str, *, part_bytes: int = PART_BYTES,
                 progress_interval: timedelta = timedelta(seconds=10), bounds: CallBounds | None = None) -> None:
        check_store_url(url)
        parsed = urlparse(url)
        if parsed.scheme not in OBJECT_SCHEMES:
            raise ConfigError(f"{shown_url(url)!r} is not an object store URL")
        self.scheme, self.bucket = parsed.scheme, parsed.netloc
        prefix = parsed.path.strip("/")
        self._root = f"{self.bucket}/{prefix}" if prefix else self.bucket
        #: The URL, as log lines show it (it never holds credentials: ``check_store_url``).
        self.name = f"{self.scheme}://{self._root}"
        self.part_bytes = max(part_bytes, _MIN_PART_BYTES)
        self.progress_interval = progress_interval.total_seconds()
        #: How long each request may wait (``coordinator.protocol.stores.bounds``).
        self.bounds = bounds or OBJECT_STORES[self.scheme]
        self._fs = _filesystem(self.scheme, self.bounds)
        self._bucket_checked = False
        self._told_ttl = False

    # -- helpers ---------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    def _key(self, path: str) -> str:
        return path[len(self._root) + 1:]

    def _failed(self, what: str, exc: BaseException) -> StoreError:
        if isinstance(exc, PermissionError):
            return StoreError(f"{self.name}: {what} was refused ({exc}); check that this job's credentials "
                              f"({_CREDENTIALS[self.scheme]}) may read and write it")
        if isinstance(exc, FileNotFoundError) and not self._bucket_exists():
            return self._no_bucket()
        # fsspec's FSTimeoutError says nothing: the timeout it stands for does.
        detail = str(exc) or str(exc.__cause__ or "")
        return StoreError(f"{self.name}: {what} failed: {type(exc).__name__}: {detail}")

    def _no_bucket(self) -> StoreError:
        kind = "container" if self.scheme == "az" else "bucket"
        return StoreError(f"{self.name}: the {kind} {self.bucket!r} does not exist; create it, or name one that "
                          "does")

    def _bucket_exists(self) -> bool:
        """Whether the bucket exists (asked once, on the first missing object: a missing
        bucket is a configuration to fix, a missing key only a miss)."""
        if self._bucket_checked:
            return True
        try:
            exists = bool(self._fs.exists(self.bucket))
        except Exception:  # cannot tell: report the call's own error
            return True
        self._bucket_checked = exists
        return exists

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except StoreError:
            raise
        except Exception as exc:  # the provider's errors: botocore, aiohttp, google, azure, OSError
            raise self._failed(what, exc) from exc

    # -- the Store interface ---------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            f = self._fs.open(path, "rb", block_size=self.part_bytes, cache_type="none")
        except FileNotFoundError as exc:
            if not self._bucket_exists():
                raise self._no_bucket() from exc
            return None
        except Exception as exc:
            raise self._failed(f"reading {key}", exc) from exc
        with f:
            size = f.size
            if size <= self.part_bytes:
                return self._call(f"reading {key}", f.read)
            value = bytearray(size)
            progress = _Progress(f"downloading {key} from {self.name}", size, self.progress_interval)
            offset = 0
            while offset < size:
                chunk = self._call(f"reading {key}", f.read, self.part_bytes)
                if not chunk:
                    raise StoreError(f"{self.name}: {key} ended at byte {offset} of {size}")
                value[offset:offset + len(chunk)] = chunk
                offset += len(chunk)
                progress.update(offset)
            progress.done()
            return bytes(value)

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        if ttl is not None and not self._told_ttl:
            self._told_ttl = True
            log.warning("%s: an object store does not expire values; set a lifecycle rule on the bucket instead "
                        "(ttl ignored)", self.name)
        path = self._path(key)
        f = self._call(f"writing {key}", self._fs.open, path, "wb", block_size=self.part_bytes)
        view = memoryview(value)
        progress = _Progress(f"uploading {key} to {self.name}", len(value), self.progress_interval,
                             quiet=len(value) <= self.part_bytes)
        try:
            for offset in range(0, len(value), self.part_bytes):
                f.write(view[offset:offset + self.part_bytes])
                progress.update(min(offset + self.part_bytes, len(value)))
            f.close()  # completes the upload: the object appears, whole
        except BaseException as exc:
            _discard(f)
            if isinstance(exc, Exception):
                raise self._failed(f"writing {key}", exc) from exc
            raise
        progress.done()

    def connect(self) -> None:
        # The provider's first request builds its HTTP session on a worker thread (aiobotocore
        # builds the TLS context with ``asyncio.to_thread``), which ``atexit`` can no longer do.
        try:
            self._bucket_exists()
        except Exception as exc:
            log.debug("%s: could not connect yet: %s", self.name, exc)

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        raise ConfigError(f"{self.name} is an object store: it keeps bundles and the persistent layer, not a "
                          "job's live claims")

    def delete(self, key: str) -> None:
        try:
            self._fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._failed(f"deleting {key}", exc) from exc

    def list_keys(self, prefix: str) -> list[str]:
        return [entry.key for entry in self.list_entries(prefix)]

    def list_entries(self, prefix: str) -> list[StoredEntry]:
        folder = f"{self._root}/{prefix.rsplit('/', 1)[0]}" if "/" in prefix else self._root
        try:
            found = self._fs.find(folder, detail=True)
        except FileNotFoundError as exc:
            if not self._bucket_exists():
                raise self._no_bucket() from exc
            return []
        except Exception as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        entries = []
        for path, info in found.items():
            key = self._key(path.lstrip("/"))
            if info.get("type") == "directory" or not key.startswith(prefix):
                continue
            entries.append(StoredEntry(key, int(info.get("size") or 0), _modified(info)))
        return sorted(entries, key=lambda entry: entry.key)


def _discard(f: Any) -> None:
    """Throw away a write that failed, without completing it (see the module)."""
    try:
        f.discard()
    except Exception as exc:  # the server may be gone: an unfinished upload expires there
        log.debug("could not abort an unfinished upload: %s", exc)
    f.closed = True  # never completed, not even when the file object is collected


def _modified(info: dict) -> float | None:
    """When an object was written, from a provider's listing (s3fs ``LastModified``, gcsfs
    ``updated``, adlfs ``last_modified``), as seconds since the epoch."""
    for field in ("LastModified", "last_modified", "updated", "mtime"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        if isinstance(value, (int, float)):
            return float(value)
    return None


class _Progress:
    """Progress lines of one long transfer: every ``interval_s``, and one at the end."""

    def __init__(self, what: str, total: int, interval_s: float, *, quiet: bool = False) -> None:
        self.what, self.total, self.interval_s, self.quiet = what, total, interval_s, quiet
        self.started = self.last = time.monotonic()
        self.done_bytes = 0

    def update(self, done: int) -> None:
        self.done_bytes = done
        now = time.monotonic()
        if self.quiet or now - self.last < self.interval_s or done >= self.total:
            return
        self.last = now
        log.info("%s: %.1f of %.1f MB (%d%%), %.1fs", self.what, done / 1e6, self.total / 1e6,
                 100 * done // max(self.total, 1), now - self.started)

    def done(self) -> None:
        if self.quiet:
            return
        elapsed = time.monotonic() - self.started
        log.info("%s: %.1f MB in %.1fs (%.0f MB/s)", self.what, self.total / 1e6, elapsed,
                 self.total / 1e6 / max(elapsed, 1e-6))
