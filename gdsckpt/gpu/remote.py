"""Restore from an S3 object straight into GPU memory: KvikIO's RemoteFile reads each chunk
record (libcurl ranged GETs, split into tasks on KvikIO's thread pool) into the ring's device
buffers, where it is verified against its checksum and decompressed into its tensor, as a local
file's chunks are. No temporary local file; the footer and index come first, by ranged GETs of
the same RemoteFile into host memory.

Endpoint and credentials: the AWS variables, which KvikIO's S3 endpoint reads itself
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION).
"""

from __future__ import annotations

import time

import kvikio
import numpy as np
import torch

from ..backend import make_backend
from ..dtypes import BY_NAME
from ..errors import GdsckptError
from .. import format as fmt
from ..remote import parse_url
from ..ring import Completion, Timings, read_chunks
from .backend import as_cupy


class RemoteDeviceFile:
    """A KvikIO RemoteFile (S3) with the ring's ChunkFile interface: pread into device memory."""

    fd = None
    io_path = "s3"

    def __init__(self, url: str, nbytes: int | None = None):
        bucket, key = parse_url(url)
        if not kvikio.is_remote_file_available():
            raise GdsckptError("this KvikIO was built without remote-file (libcurl) support")
        self.url = url
        self._f = kvikio.RemoteFile.open_s3(bucket, key, nbytes)

    def nbytes(self) -> int:
        return self._f.nbytes()

    def read_host(self, nbytes: int, offset: int) -> bytes:
        """`nbytes` at `offset` into host memory (fewer past the end): the footer and index."""
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        got = self._f.pread(buf, nbytes, offset).get() if nbytes else 0
        return buf[:got].tobytes()

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._f.pread(as_cupy(buf[:nbytes]), nbytes, offset).get)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self.url} is opened for reading")

    def close(self) -> None:
        self._f.close()


def read_tensors(url: str, *, ring_depth: int = 2, io_threads: int | None = None) -> tuple[dict, dict]:
    """Every tensor of the checkpoint object `url`, on the current GPU, keyed as saved; and the
    read's stats (seconds, bytes, stages). Each chunk record's checksum is checked on the GPU
    before a decoder sees it; a mismatch raises ChecksumError naming the URL, key and chunk."""
    t0 = time.perf_counter()
    f = RemoteDeviceFile(url)
    try:
        size = f.nbytes()
        index = fmt.read_index(f.read_host, size, url)
    except BaseException:
        f.close()
        raise
    t_index = time.perf_counter() - t0
    plan = index.plan
    dev = torch.device("cuda", torch.cuda.current_device())
    out = [torch.empty(t.shape, dtype=BY_NAME[t.dtype], device=dev) for t in plan.tensors]
    views = [t.reshape(-1).view(torch.uint8) for t in out]
    timings = Timings()
    with make_backend("gpu", io_threads=io_threads) as be:
        try:
            be.begin()
            read_chunks(index, [c.index for c in plan.chunks], views, be, f, ring_depth, timings, url)
            be.finish()
        finally:
            f.close()
    torch.cuda.synchronize()
    stored = sum(r.stored for r in index.records)
    stats = {"seconds": time.perf_counter() - t0, "index_seconds": t_index, "object_bytes": size,
             "stored_bytes": stored, "logical_bytes": sum(c.length for c in plan.chunks),
             "chunks": len(plan.chunks), "stages": dict(timings.stages)}
    return {t.key: out[i] for i, t in enumerate(plan.tensors)}, stats
