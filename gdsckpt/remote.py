"""The object-store tier's transition names, while callers move to gdsckpt.stores: ObjectStore
(an S3Store with the older method names upload and verify), parse_url, is_remote; and the sources
the reader reads an s3:// checkpoint through (S3Source, RemoteHostFile).

    store = ObjectStore("s3://bucket/run7")       # gdsckpt.stores.open_store(url) in new code
    with S3Source.open("s3://bucket/run7/step_00001000.gdsckpt") as src: src.pread(n, offset)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .errors import GdsckptError
from .store_verify import verify_object
from .stores import UploadResult, is_remote  # noqa: F401 - the older names
from .stores.s3 import SCHEME, S3Store, parse_url  # noqa: F401


class ObjectStore(S3Store):
    """An S3Store under the names the manager and the CLI still call."""

    def upload(self, path, name: str) -> UploadResult:
        return self.put_file(path, name)

    def verify(self, name: str, *, expected_size: int | None = None) -> dict:
        return verify_object(self, name, expected_size=expected_size)


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


class RemoteHostFile:
    """The ring's ChunkFile over an S3 object for the CPU backend: each chunk record is one ranged
    GET into the ring's host buffer, on a small thread pool so that reads overlap decoding."""

    fd = None

    def __init__(self, url: str, threads: int = 4):
        self._src = S3Source(url)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdsckpt-s3-read")

    def pread(self, buf, nbytes: int, offset: int):
        from .ring import Completion

        def read() -> int:
            data = self._src.pread(nbytes, offset)
            buf.numpy()[:len(data)] = memoryview(data)
            return len(data)
        return Completion(self._pool.submit(read).result)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self._src.url} is opened for reading")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
