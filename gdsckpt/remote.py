"""The object-store tier: checkpoint files to and from any S3-compatible store.

    store = ObjectStore("s3://bucket/run7")       # endpoint and credentials: the AWS variables
    store.upload("/ckpt/step_00001000.gdsckpt", "step_00001000.gdsckpt")   # multipart, parts in parallel
    store.verify("step_00001000.gdsckpt")         # every chunk against gdsckpt's own checksums
    with S3Source.open("s3://bucket/run7/step_00001000.gdsckpt") as src: src.pread(n, offset)

The client is obstore (Rust object_store), chosen by measurement against boto3/s3transfer
(bench/probes/probe_s3_upload.py; bench/results/2026-11-23-cpu-s3/upload.json: 256 MiB of unique
bytes to a loopback SeaweedFS on this project's 2-core CPU machine, loaded by other jobs, 3
interleaved rounds). Every method, single PUT or multipart, reached 29-47 MB/s: the server, on
the same two cores, was the limit, so parallel parts could not show a gain. The client's own
CPU differed: obstore with 8 MiB parts 1.46-1.55 s per GB, boto3's upload_file 2.37-2.74 s per
GB; and obstore moves the bytes outside the GIL, which matters for an uploader that shares a
process with a training loop.

Endpoint and credentials come from the standard variables, read by obstore itself:
AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION (and on AWS the instance or container
role). Nothing here logs or formats a credential: errors name the bucket, the key and the
store's error code.

An upload counts only once `verify` has read the object back and every chunk record, the index
and the footer matched the checksums gdsckpt recorded when it wrote the file: the upload call's
own success is not trusted (a torn or mangled object fails here, and the caller keeps its local copy).
"""

from __future__ import annotations

import datetime
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import (
    BucketNotFoundError, CheckpointFormatError, RemoteAccessError, RemoteNotFoundError,
    RemoteStoreError, RemoteUnavailableError,
)

SCHEME = "s3://"
# 8 MiB parts: the least client CPU per GB in the loopback probe (larger parts cost obstore more);
# 8 in flight: a real store's latency needs parts in parallel, which a loopback one cannot show.
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_CONCURRENCY = 8
# Verify reads chunk records in ranged GETs of at most this many bytes, `concurrency` at a time.
VERIFY_READ_BYTES = 32 << 20

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_CODE = re.compile(r"<Code>([A-Za-z0-9]+)</Code>")
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                 "ExpiredToken", "AllAccessDisabled", "InvalidSecurity"}


def is_remote(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, str]:
    """"s3://bucket/some/prefix" -> ("bucket", "some/prefix") (no leading or trailing slash)."""
    if not is_remote(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 characters: lower-case "
                         "letters, digits, dots and hyphens)")
    return bucket, prefix.strip("/")


def _endpoint() -> str | None:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def _obstore():
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError as e:  # the remote tier is an extra
        raise ImportError("the object-store tier needs obstore: pip install 'gdsckpt[s3]'") from e
    return obstore, S3Store


def _short(message: str) -> str:
    """The first line of a client error, without the debug dump that follows it."""
    first = message.split("\n", 1)[0].split("Debug source", 1)[0].strip()
    return first[:300]


@dataclass
class UploadResult:
    key: str
    bytes: int
    seconds: float
    parts: int

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


class ObjectStore:
    """A bucket and a key prefix on an S3-compatible store.

    part_bytes / concurrency: multipart upload part size and parts in flight (also the number
    of ranged GETs `verify` keeps in flight). max_retries / retry_seconds: the client retries
    5xx answers, dropped connections and timeouts with exponential backoff, for at most
    `retry_seconds` per request; after that a RemoteUnavailableError names the bucket.
    """

    def __init__(self, url: str, *, part_bytes: int = DEFAULT_PART_BYTES, concurrency: int = DEFAULT_CONCURRENCY,
                 max_retries: int = 5, retry_seconds: float = 60.0, connect_timeout: float = 5.0,
                 request_timeout: float = 300.0):
        if part_bytes < 5 << 20:
            raise ValueError(f"part_bytes must be at least 5 MiB (S3's minimum part size), got {part_bytes}")
        self.bucket, self.prefix = parse_url(url)
        self.part_bytes, self.concurrency = part_bytes, max(1, concurrency)
        _, S3Store = _obstore()
        endpoint = _endpoint()
        client = {"connect_timeout": datetime.timedelta(seconds=connect_timeout),
                  "timeout": datetime.timedelta(seconds=request_timeout)}
        if endpoint and endpoint.startswith("http://"):
            client["allow_http"] = True  # an on-premise or loopback store named by the user
        retry = {"max_retries": max_retries, "retry_timeout": datetime.timedelta(seconds=retry_seconds),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                             "max_backoff": datetime.timedelta(seconds=5), "base": 2}}
        try:
            self._store = S3Store(self.bucket, client_options=client, retry_config=retry)
        except Exception as e:  # a malformed variable, say; obstore's message names the setting, not its value
            raise RemoteStoreError(f"cannot configure the S3 client: {_short(str(e))}", bucket=self.bucket) from None

    # -- names
    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str = "") -> str:
        return f"{SCHEME}{self.bucket}/{self.key(name)}" if name else f"{SCHEME}{self.bucket}/{self.prefix}"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url()!r})"

    # -- errors
    def _error(self, e: BaseException, what: str, key: str | None) -> RemoteStoreError:
        msg = str(e)
        m = _CODE.search(msg)
        code = m.group(1) if m else None
        name = type(e).__name__
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: the bucket does not exist on the store", bucket=self.bucket,
                                       key=key, code=code)
        if code in _ACCESS_CODES or name in ("PermissionDeniedError", "UnauthenticatedError"):
            return RemoteAccessError(f"{what}: the store refused the credentials (AWS_ACCESS_KEY_ID / "
                                     "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN; values not shown)",
                                     bucket=self.bucket, key=key, code=code or name)
        if isinstance(e, FileNotFoundError) or name == "NotFoundError":
            return RemoteNotFoundError(f"{what}: no such object", bucket=self.bucket, key=key, code=code)
        if "error sending request" in msg or "retries" in msg or "timed out" in msg.lower():
            return RemoteUnavailableError(f"{what}: the store at {_endpoint() or 'the AWS default endpoint'} "
                                          f"did not answer after the client's retries ({_short(msg)})",
                                          bucket=self.bucket, key=key, code=code)
        return RemoteStoreError(f"{what} failed: {_short(msg)}", bucket=self.bucket, key=key, code=code)

    def _call(self, what: str, key: str | None, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RemoteStoreError:
            raise
        except Exception as e:
            raise self._error(e, what, key) from None

    # -- objects
    def upload(self, path: str | os.PathLike, name: str) -> UploadResult:
        """Put the file `path` at `name`: one PUT when it fits in a part, else a multipart upload
        with `concurrency` parts in flight (the object appears only when complete)."""
        obstore, _ = _obstore()
        path = Path(path)
        size = path.stat().st_size
        key = self.key(name)
        t = time.perf_counter()
        multipart = size > self.part_bytes
        # A Path, not a file object: obstore opens and reads it in Rust, outside the GIL.
        self._call("upload", key, obstore.put, self._store, key, path, use_multipart=multipart,
                   chunk_size=self.part_bytes, max_concurrency=self.concurrency)
        return UploadResult(key, size, time.perf_counter() - t, -(-size // self.part_bytes) if multipart else 1)

    def put_bytes(self, name: str, data: bytes) -> None:
        obstore, _ = _obstore()
        key = self.key(name)
        self._call("put", key, obstore.put, self._store, key, data, use_multipart=False)

    def get_bytes(self, name: str) -> bytes:
        obstore, _ = _obstore()
        key = self.key(name)
        return self._call("get", key, lambda: bytes(obstore.get(self._store, key).bytes()))

    def read(self, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (one ranged GET); fewer only past the end of the object."""
        if length <= 0:
            return b""
        obstore, _ = _obstore()
        key = self.key(name)
        return self._call("ranged read", key, lambda: bytes(
            obstore.get_range(self._store, key, start=offset, length=length)))

    def size(self, name: str) -> int:
        obstore, _ = _obstore()
        key = self.key(name)
        return int(self._call("head", key, obstore.head, self._store, key)["size"])

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except RemoteNotFoundError:
            return False
        return True

    def list(self, under: str = "") -> dict[str, int]:
        """{name relative to the prefix: size} of every object under prefix/under."""
        obstore, _ = _obstore()
        base = self.key(under) if under else self.prefix
        query = base + "/" if base and not base.endswith("/") else base
        out = {}

        def run():
            for batch in obstore.list(self._store, prefix=query or None):
                for meta in batch:
                    path = meta["path"]
                    rel = path[len(self.prefix) + 1:] if self.prefix else path
                    out[rel] = int(meta["size"])

        self._call("list", query or None, run)
        return out

    def delete(self, name: str) -> None:
        obstore, _ = _obstore()
        key = self.key(name)
        self._call("delete", key, obstore.delete, self._store, key)

    def download(self, name: str, path: str | os.PathLike) -> int:
        """The object at `name` into the file `path`, written to a temporary beside it, fsync'd and
        renamed (a failed download leaves nothing at `path`). Ranged GETs in parallel."""
        from .storage import commit, pwrite_all, temp_path_for
        path = Path(path)
        size = self.size(name)
        tmp = temp_path_for(path)  # named as a save's temporary: `gdsckpt clean` finds a leftover
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            step = max(self.part_bytes, VERIFY_READ_BYTES)

            def piece(off):
                data = self.read(name, off, min(step, size - off))
                if len(data) != min(step, size - off):
                    raise RemoteStoreError(f"download: short read at {off}", bucket=self.bucket, key=self.key(name))
                pwrite_all(fd, data, off)

            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="gdsckpt-s3-get") as pool:
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

    def verify(self, name: str, *, expected_size: int | None = None) -> dict:
        """Read the object back and check it against gdsckpt's own checksums: the footer and the
        index (validated as any reader validates them), then every chunk record, in ranged GETs,
        `concurrency` at a time. Raises CheckpointFormatError / ChecksumError naming the s3:// URL,
        key and chunk, or RemoteStoreError."""
        from . import format as fmt
        from .checksum import ALGORITHMS
        from .ring import verify_chunk

        url = self.url(name)
        size = self.size(name)
        if expected_size is not None and size != expected_size:
            raise CheckpointFormatError(f"the object is {size} bytes but the local file is {expected_size}: "
                                        "a torn or partial upload", path=url)
        t = time.perf_counter()
        index = fmt.read_index(lambda n, o: self.read(name, o, n), size, url)
        algorithm = ALGORITHMS[index.checksum]
        plan, records = index.plan, index.records

        def check(i):
            rec, chunk = records[i], plan.chunks[i]
            data = self.read(name, rec.file_offset, rec.stored)
            key = plan.tensors[chunk.segments[0].tensor].key if chunk.segments else None
            verify_chunk(len(data), algorithm(data) if len(data) == rec.stored else 0, rec, url, key, i)
            return rec.stored

        checked = 0
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="gdsckpt-s3-verify") as pool:
            # bounded: at most `concurrency` chunk records in memory at once
            pending = []
            for i in range(len(records)):
                pending.append(pool.submit(check, i))
                if len(pending) >= self.concurrency:
                    checked += pending.pop(0).result()
            for f in pending:
                checked += f.result()
        return {"url": url, "bytes": size, "chunks": len(records), "stored_bytes": checked,
                "seconds": time.perf_counter() - t}


class S3Source:
    """A checkpoint object read by ranged GETs: the file-like source gdsckpt.open("s3://...") reads
    through (footer and index on open, then only the chunk records a caller asks for)."""

    def __init__(self, url: str, **store_options):
        bucket, key = parse_url(url)
        if not key:
            raise ValueError(f"{url!r} names a bucket, not an object")
        prefix, _, name = key.rpartition("/")
        self.store = ObjectStore(f"{SCHEME}{bucket}/{prefix}", **store_options)
        self.name, self.url = name, url
        self.size = self.store.size(name)

    def pread(self, n: int, offset: int) -> bytes:
        return self.store.read(self.name, offset, n)
