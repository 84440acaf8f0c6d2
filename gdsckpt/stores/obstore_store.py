"""The Store protocol over any obstore client (S3 today; obstore's GCS and Azure stores take the
same calls): bounded requests, errors classified into gdsckpt's RemoteStoreError types, multipart
uploads and ranged downloads with parts in parallel.

The client is obstore (Rust object_store), chosen by measurement against boto3/s3transfer
(bench/probes/probe_s3_upload.py; bench/results/2026-11-23-cpu-s3/upload.json: 256 MiB of unique
bytes to a loopback SeaweedFS on this project's 2-core CPU machine, loaded by other jobs, 3
interleaved rounds). Every method, single PUT or multipart, reached 29-47 MB/s: the server, on
the same two cores, was the limit, so parallel parts could not show a gain. The client's own
CPU differed: obstore with 8 MiB parts 1.46-1.55 s per GB, boto3's upload_file 2.37-2.74 s per
GB; and obstore moves the bytes outside the GIL, which matters for an uploader that shares a
process with a training loop.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Iterable

from ..errors import (
    BucketNotFoundError, RemoteAccessError, RemoteNotFoundError, RemoteStoreError, RemoteTimeoutError,
    RemoteUnavailableError,
)
from . import UploadResult

# 8 MiB parts: the least client CPU per GB in the loopback probe (larger parts cost obstore more);
# 8 in flight: a real store's latency needs parts in parallel, which a loopback one cannot show.
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_CONCURRENCY = 8
# Every request, its retries included, ends within this many seconds (issue 20: a store that
# accepts connections and never answers held latest_step() and restore() for 300 s).
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_RETRIES = 5

# The store's own error code, from the XML error document S3 (and GCS's XML API, and Azure) send
# with a 4xx/5xx answer; obstore passes the document on in its message only.
_STORE_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
# The transport failure, as obstore (0.12) records it: its exceptions do not type a timeout or a
# refused connection (both are GenericError), but its debug record names object_store's
# HttpErrorKind (Connect, Request, Timeout, Interrupted, Decode, Unknown).
_TRANSPORT = re.compile(r"HttpError \{\s*kind: (\w+)")


def bounded_client(timeout: float, max_retries: int, *, allow_http: bool) -> tuple[dict, dict]:
    """obstore's client_options and retry_config for requests that end within `timeout` seconds,
    retries included: each attempt may take half of it, and a retry starts only in the first half
    (object_store retries until `retry_timeout` has passed, and an attempt started then may run
    its full time; so attempt + window + the last backoff stay within the bound)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")
    seconds = datetime.timedelta
    attempt = timeout / 2
    max_backoff = min(1.0, timeout / 10)
    client = {"timeout": seconds(seconds=attempt), "connect_timeout": seconds(seconds=min(attempt, 5.0))}
    if allow_http:
        client["allow_http"] = True  # an on-premise or loopback store the user named
    retry = {"max_retries": max_retries, "retry_timeout": seconds(seconds=max(0.0, attempt - max_backoff)),
             "backoff": {"init_backoff": seconds(seconds=min(0.1, max_backoff)),
                         "max_backoff": seconds(seconds=max_backoff), "base": 2}}
    return client, retry


def obstore_module():
    try:
        import obstore
    except ImportError as e:  # the object-store tier is an extra
        raise ImportError("the object-store tier needs obstore: pip install 'gdsckpt[s3]'") from e
    return obstore


def _first_line(message: str) -> str:
    """The first line of a client error, without the debug record that follows it."""
    return message.split("\n", 1)[0].split("Debug source", 1)[0].strip()[:300]


class ObstoreStore:
    """A root (bucket and key prefix) in an obstore store; the Store protocol.

    client: the obstore store (built by the scheme's module). scheme / bucket / prefix: the root,
    for keys and URLs. endpoint: where the store is, named in errors. part_bytes / concurrency:
    multipart part size and parts (or ranged reads) in flight. timeout: the bound of every request
    (bounded_client built the client with it). secrets: the credential values in use, so that no
    error text carries one. missing_credentials: why no credentials were found, if none were:
    every call then fails with a RemoteAccessError that says so.
    """

    # The store's error codes that mean "no such bucket" and "refused credentials or permission".
    BUCKET_MISSING_CODES: frozenset = frozenset()
    ACCESS_CODES: frozenset = frozenset()
    CREDENTIALS_HINT = ""

    def __init__(self, client, *, scheme: str, bucket: str, prefix: str, endpoint: str,
                 part_bytes: int = DEFAULT_PART_BYTES, concurrency: int = DEFAULT_CONCURRENCY,
                 timeout: float = DEFAULT_TIMEOUT, secrets: Callable[[], Iterable[str]] = tuple,
                 missing_credentials: str | None = None):
        if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 5 << 20:
            raise ValueError(f"part_bytes must be an int of at least 5 MiB (S3's minimum part size), "
                             f"got {part_bytes!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        self.client, self.scheme, self.bucket, self.prefix = client, scheme, bucket, prefix
        self.endpoint, self.timeout = endpoint, float(timeout)
        self.part_bytes, self.concurrency = part_bytes, concurrency
        self._secrets, self._missing_credentials = secrets, missing_credentials

    # -- names
    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{self.key(name) if name else self.prefix}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url()!r})"

    # -- errors
    def redact(self, text: str) -> str:
        for secret in self._secrets():
            if secret and len(secret) >= 4:
                text = text.replace(secret, "<secret>")
        return text

    def error(self, e: BaseException, what: str, key: str | None) -> RemoteStoreError:
        """The RemoteStoreError for the client's exception `e`: by its type first (obstore's
        PermissionDeniedError, UnauthenticatedError, FileNotFoundError / NotFoundError), then by the
        store's error code, then by the transport failure; "did not answer" only for a timeout."""
        from obstore import exceptions as ox
        text = self.redact(str(e))
        m = _STORE_CODE.search(text)
        code = m.group(1) if m else None
        m = _TRANSPORT.search(text)
        transport = m.group(1) if m else None
        where = {"bucket": self.bucket, "key": key}
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or code in self.ACCESS_CODES:
            return RemoteAccessError(f"{what}: the store refused the request: wrong credentials or no permission "
                                     f"on the bucket{self.CREDENTIALS_HINT}", code=code or type(e).__name__, **where)
        if code in self.BUCKET_MISSING_CODES:
            return BucketNotFoundError(f"{what}: the bucket does not exist on the store", code=code, **where)
        if isinstance(e, (FileNotFoundError, ox.NotFoundError)):
            return RemoteNotFoundError(f"{what}: no such object", code=code, **where)
        if code is None and transport == "Timeout":
            return RemoteTimeoutError(f"{what}: the store at {self.endpoint} did not answer within {self.timeout:g} s "
                                      "(the store's `timeout` option)", code="Timeout", **where)
        if code is None and transport in ("Connect", "Interrupted", "Request"):
            return RemoteUnavailableError(f"{what}: cannot reach the store at {self.endpoint} after the client's "
                                          f"retries ({_first_line(text)})", code=transport, **where)
        return RemoteStoreError(f"{what} failed: {_first_line(text)}", code=code, **where)

    def call(self, what: str, key: str | None, fn, *args, **kwargs):
        """fn(*args, **kwargs), its failure as a RemoteStoreError (never with a credential in it)."""
        if self._missing_credentials is not None:
            raise RemoteAccessError(f"{what}: {self._missing_credentials}", bucket=self.bucket, key=key,
                                    code="NoCredentials")
        try:
            return fn(*args, **kwargs)
        except RemoteStoreError:
            raise
        except Exception as e:
            raise self.error(e, what, key) from None

    # -- objects
    def put_file(self, path: str | os.PathLike, name: str) -> UploadResult:
        """Put the file `path` at `name`: one PUT when it fits in a part, else a multipart upload
        with `concurrency` parts in flight (the object appears only when complete)."""
        obstore = obstore_module()
        path = Path(path)
        size = path.stat().st_size
        key = self.key(name)
        t = time.perf_counter()
        multipart = size > self.part_bytes
        # A Path, not a file object: obstore opens and reads it in Rust, outside the GIL.
        self.call("upload", key, obstore.put, self.client, key, path, use_multipart=multipart,
                  chunk_size=self.part_bytes, max_concurrency=self.concurrency)
        return UploadResult(key, size, time.perf_counter() - t, -(-size // self.part_bytes) if multipart else 1)

    def put_bytes(self, name: str, data: bytes) -> None:
        obstore = obstore_module()
        key = self.key(name)
        self.call("put", key, obstore.put, self.client, key, data, use_multipart=False)

    def get_bytes(self, name: str) -> bytes:
        obstore = obstore_module()
        key = self.key(name)
        return self.call("get", key, lambda: bytes(obstore.get(self.client, key).bytes()))

    def read(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        obstore = obstore_module()
        key = self.key(name)
        return self.call("ranged read", key, lambda: bytes(
            obstore.get_range(self.client, key, start=offset, length=length)))

    def size(self, name: str) -> int:
        obstore = obstore_module()
        key = self.key(name)
        return int(self.call("head", key, obstore.head, self.client, key)["size"])

    def list(self, under: str = "") -> dict[str, int]:
        """Within `timeout` as a whole, not only each page's request: a listing is a request per
        1000 keys, and a store that answers each page slowly would otherwise hold the caller for
        pages x timeout. The pages come on a thread of their own, which stops at its next page
        once the caller has given up."""
        obstore = obstore_module()
        base = self.key(under) if under else self.prefix
        query = base + "/" if base and not base.endswith("/") else base
        out, late = {}, threading.Event()

        def run():
            for batch in obstore.list(self.client, prefix=query or None):
                if late.is_set():
                    return
                for meta in batch:
                    path = meta["path"]
                    rel = path[len(self.prefix) + 1:] if self.prefix else path
                    out[rel] = int(meta["size"])

        pool = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-store-list")
        try:
            listing = pool.submit(self.call, "list", query or None, run)
            try:
                listing.result(timeout=self.timeout)
            except FutureTimeout:
                late.set()
                raise RemoteTimeoutError(f"list: the store at {self.endpoint} did not answer within {self.timeout:g} s "
                                         f"(the listing of {self.scheme}://{self.bucket}/{query}, all its pages; "
                                         "the store's `timeout` option)",
                                         bucket=self.bucket, key=query or None, code="Timeout") from None
        finally:
            pool.shutdown(wait=False)
        return out

    def delete(self, name: str) -> None:
        obstore = obstore_module()
        key = self.key(name)
        self.call("delete", key, obstore.delete, self.client, key)

    def download(self, name: str, path: str | os.PathLike) -> int:
        """Ranged GETs of a part each, `concurrency` in flight, into a temporary beside `path`
        (named as a save's temporary, so that `gdsckpt clean` finds a leftover), fsync'd and
        renamed: a failed download leaves nothing at `path`."""
        from gdsckpt.core.storage import commit, pwrite_all, temp_path_for
        path = Path(path)
        size = self.size(name)
        tmp = temp_path_for(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            step = self.part_bytes

            def piece(off):
                want = min(step, size - off)
                data = self.read(name, off, want)
                if len(data) != want:
                    raise RemoteStoreError(f"download: {len(data)} bytes at offset {off} where {want} were asked "
                                           "for: the object changed meanwhile", bucket=self.bucket, key=self.key(name))
                pwrite_all(fd, data, off)

            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="gdsckpt-store-get") as pool:
                for f in [pool.submit(piece, off) for off in range(0, size, step)]:
                    f.result()
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        commit(tmp, path)
        return size
