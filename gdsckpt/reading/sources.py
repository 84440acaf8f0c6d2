"""Where a checkpoint's bytes come from when it is read: a `ChunkSource`.

The reader (gdsckpt/reading/reader.py) reads the footer and index, and checks chunks on the CPU, through
`pread`; the ring reads chunk records through the ChunkFile that `open_chunks` makes for its
backend. `open_source` picks the source for what the user named:

* `LocalFile`: a file, held open from open to close, so that every read goes to the file that
  was opened even after a save renames a new checkpoint over its path; read into a GPU without
  GPUDirect Storage, ahead of the ring (gdsckpt/engine/read_ahead.py);
* `StoreObject`: an object in a store ("s3://bucket/key"), read by ranged GETs only, nothing
  downloaded whole: into host memory, or on the GPU straight into device memory through
  KvikIO's RemoteFile (gdsckpt/engine/gpu/remote.py).

A child process that decodes for an untrusted read (gdsckpt/reading/isolated.py) opens the parent's
file again through `ChildFile`: local files only.
"""

from __future__ import annotations

import os
import stat
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gdsckpt.engine.backend import gpu_io_path
from gdsckpt.core.defaults import (
    CHUNK_BYTES, KVIKIO_READ_TASK_BYTES, READ_AHEAD_BLOCK_BYTES, READ_AHEAD_PINNED, READ_AHEAD_THREADS,
)
from gdsckpt.errors import CheckpointFormatError, GdsckptError
from gdsckpt.format.file import HEADER_SIZE
from gdsckpt.engine.read_ahead import ReadAheadFile
# The object-store seam: the one place the reader depends on it.
from gdsckpt.stores import is_remote, open_store, scheme_of
from gdsckpt.engine.interfaces import Backend, ChunkFile
from gdsckpt.engine.ring import Completion
from gdsckpt.core.storage import pread_exact, user_path
from .interfaces import ChildFile, ChunkSource

# Ranged GETs a store object's host ChunkFile keeps in flight, so that reads overlap decoding.
STORE_READ_THREADS = 4


def locate(path) -> Path | str | ChunkSource:
    """What `path` names: an object in a store (its URL, a str), else a local file (a Path);
    a ChunkSource as it is (a memory copy: gdsckpt/manager/memory/source.py); a TypeError for what
    names none of them (None, a number, a file object)."""
    if hasattr(path, "open_chunks") and hasattr(path, "pread"):
        return path
    return path if is_remote(path) else user_path(path, "open")


def open_source(where: Path | str | ChunkSource, *, trusted: bool = True) -> ChunkSource:
    """The source of the checkpoint `where` (from `locate`). trusted=False: a local file only
    (its chunks go to a child process, which must open the same file); refused before the store
    is asked anything."""
    if not isinstance(where, (str, Path)):  # a ChunkSource already
        if not trusted:
            raise ValueError(f"trusted=False reads local files only, not {where.label}")
        return where
    if is_remote(where):
        if not trusted:
            raise ValueError("trusted=False reads local files only: download the object first")
        return StoreObject(where)
    return LocalFile(Path(where))


class LocalFile:
    """A checkpoint file. The descriptor stays open until close() (or until this object is
    collected): every read goes to this file even if a save replaces the path. Reads after close()
    go by the path, and refuse a file that is not the one opened."""

    io_threads = None
    io = "auto"
    read_task_bytes = KVIKIO_READ_TASK_BYTES

    def __init__(self, path: Path):
        self.label = path
        # O_NONBLOCK: a FIFO given by mistake must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointFormatError("not a regular file, so not a checkpoint", path=path)
        except BaseException:
            self._closer()
            raise
        self.identity = (st.st_dev, st.st_ino)
        self.size = st.st_size
        self._ahead: ReadAheadFile | None = None  # read_ahead's, until open_chunks takes it

    def read_ahead(self, end: int, io: str) -> None:
        """A whole restore is to read every record, those below `end` (the index's offset), once its
        index is parsed and its plan made: where the ring will read them ahead into a GPU (its backend
        with io=`io` in compat mode), begin now, beside the parse and the plan. A ring on another
        backend, or a plan that reads other records, drops these reads (at most a window's worth)."""
        if self._ahead is None and READ_AHEAD_THREADS and io != "gds" and gpu_io_path(io) == "compat":
            self._ahead = self._read_ahead_file()
            self._ahead.expect(HEADER_SIZE, end, CHUNK_BYTES["gpu"])

    def pread(self, n: int, offset: int) -> bytes:
        if self._closer.alive:
            return pread_exact(self._fd, n, offset)
        fd = os.open(self.label, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self._check_same(fd)
            return pread_exact(fd, n, offset)
        finally:
            os.close(fd)

    def open_chunks(self, backend: Backend) -> ChunkFile:
        ahead, self._ahead = self._ahead, None
        if backend.name == "gpu" and backend.io_path == "compat" and READ_AHEAD_THREADS:
            file = ahead or self._read_ahead_file()
            file.copy = backend.copy
        else:
            if ahead is not None:
                ahead.close()
            file = backend.open(self._reopen_path(), "r")
        try:
            self._check_same(file.fd)
        except BaseException:
            file.close()
            raise
        return file

    def child_file(self) -> ChildFile:
        fd = self._fd if self._closer.alive else None
        return ChildFile(f"/proc/self/fd/{fd}" if fd is not None else str(self.label), fd, self.identity)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        self._closer()

    def _read_ahead_file(self) -> ReadAheadFile:
        return ReadAheadFile(self._reopen_path(), threads=READ_AHEAD_THREADS, block=READ_AHEAD_BLOCK_BYTES,
                             pinned=READ_AHEAD_PINNED, label=self.label)

    def _reopen_path(self) -> Path:
        """The file opened, by a path a concurrent save's rename cannot redirect (/proc/self/fd on
        Linux); the path itself once closed, or where there is no /proc."""
        if self._closer.alive:
            p = Path(f"/proc/self/fd/{self._fd}")
            if p.exists():
                return p
        return self.label

    def _check_same(self, fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            raise CheckpointFormatError("the file was replaced since it was opened: open it again", path=self.label)


class StoreObject:
    """A checkpoint object in a store, read by ranged GETs: the footer and index on open, then
    only the chunk records a caller asks for. Endpoint and credentials: the AWS variables."""

    io_threads = None
    io = "auto"
    read_task_bytes = None  # its chunks come by GET into host memory, not through KvikIO

    def __init__(self, url: str):
        self.label = url
        where, _, self._name = url.partition("://")[2].rpartition("/")
        if not where or self._name in ("", ".", ".."):
            raise ValueError(f"{url!r} names a bucket or a prefix, not an object")
        self._store = open_store(url[:-len(self._name) - 1])
        # The store's own reading of its root (open_store refuses an empty, "." or ".." segment,
        # but drops one trailing "/"): "s3://b/p//x" would read the other object "p/x".
        if self._store.url(self._name) != url:
            raise ValueError(f"{url!r}: the path has an empty ('//'), '.' or '..' segment (the store would read "
                             f"{self._store.url(self._name)!r}, another object); name it without them")
        self.size = self._store.size(self._name)

    def pread(self, n: int, offset: int) -> bytes:
        return self._store.read(self._name, offset, n)

    def open_chunks(self, backend: Backend) -> ChunkFile:
        if backend.name == "gpu":  # into device memory: KvikIO's RemoteFile, which speaks S3 itself
            if scheme_of(self.label) != "s3":
                raise GdsckptError(f"{self.label}: reading into GPU memory goes through KvikIO's RemoteFile, "
                                   "which reads s3:// objects only")
            from gdsckpt.engine.gpu.remote import RemoteDeviceFile
            from gdsckpt.stores.s3 import parse_url
            bucket, key = parse_url(self.label)
            return RemoteDeviceFile(self.label, bucket, key, self.size)
        return RangedHostFile(self.pread, self.label)

    def child_file(self) -> ChildFile:
        raise ValueError(f"{self.label}: a child process decodes local files only: download the object first")

    def close(self) -> None:
        pass  # no connection is held between requests


class RangedHostFile:
    """The ring's ChunkFile over ranged reads into host memory (the CPU backend's buffers): each
    chunk record is one `pread` on a small thread pool, so that reads overlap decoding."""

    fd = None

    def __init__(self, pread, label: str, threads: int = STORE_READ_THREADS):
        self._pread, self._label = pread, label
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdsckpt-s3-read")

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        def read() -> int:
            data = self._pread(nbytes, offset)
            buf.numpy()[:len(data)] = memoryview(data)
            return len(data)
        return Completion(self._pool.submit(read).result)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self._label} is opened for reading")

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class DeviceImage:
    """A checkpoint's image, byte for byte its file, held in device memory (a uint8 CUDA tensor):
    one received from a peer's replica (gdsckpt/manager/replicas/wire.py). On the GPU backend its
    chunk records are checked and decoded where they lie (`DeviceView`, a MappedChunkFile): no
    copy, no host memory; the footer and index come to the host by small reads."""

    io_threads = None
    io = "compat"  # nothing is read from a file; the backend opens none
    read_task_bytes = None

    def __init__(self, image, label: str):
        self.image, self.label, self.size = image, label, image.numel()

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        return self.image[offset:offset + n].cpu().numpy().tobytes()

    def open_chunks(self, backend: Backend) -> ChunkFile:
        return DeviceView(self.image if backend.name == "gpu" else self.image.cpu(), self.label)

    def child_file(self) -> ChildFile:
        raise ValueError(f"{self.label}: an image in device memory is read in this process only")

    def close(self) -> None:
        pass  # its owner frees the image


class DeviceView:
    """A MappedChunkFile over an image in the backend's memory: records viewed in place."""

    fd = None

    def __init__(self, image, label: str):
        self._image, self._label = image, label

    def view(self, nbytes: int, offset: int):
        return self._image[offset:offset + nbytes]

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        src = self.view(nbytes, offset)
        buf[:src.numel()].copy_(src)
        return Completion(lambda n=src.numel(): n)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self._label} is opened for reading")

    def close(self) -> None:
        pass
