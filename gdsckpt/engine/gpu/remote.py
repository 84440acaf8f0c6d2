"""Chunk records of an S3 object read straight into GPU memory: KvikIO's RemoteFile (libcurl
ranged GETs, split into tasks on KvikIO's thread pool) with the ring's ChunkFile interface, so
that each record lands in the ring's device buffers, where it is verified against its checksum
and decompressed into its tensor as a local file's chunks are. No temporary local file. The
reader's store-object source (gdsckpt/reading/sources.py) opens one for the GPU backend; the footer and
index come through the store client, by ranged GETs into host memory.

Endpoint and credentials: the AWS variables, which KvikIO's S3 endpoint reads itself
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION).
"""

from __future__ import annotations

import kvikio

from gdsckpt.errors import GdsckptError
from gdsckpt.engine.ring import Completion
from .backend import as_cupy


class RemoteDeviceFile:
    """A KvikIO RemoteFile (S3) with the ring's ChunkFile interface: pread into device memory.
    `url` names the object in errors; `bucket` and `key` are its parts; `nbytes` its size."""

    fd = None

    def __init__(self, url: str, bucket: str, key: str, nbytes: int):
        if not kvikio.is_remote_file_available():
            raise GdsckptError("this KvikIO was built without remote-file (libcurl) support")
        self.url = url
        self._f = kvikio.RemoteFile.open_s3(bucket, key, nbytes)

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._f.pread(as_cupy(buf[:nbytes]), nbytes, offset).get)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self.url} is opened for reading")

    def close(self) -> None:
        self._f.close()
