"""The CPU backend: numpy views of host tensors, zstd (zstandard) and raw codecs, os.pwrite /
os.pread on a small thread pool. It runs wherever there is no GPU, CI included, and reads any
chunk that has a CPU decoder."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from .checksum import checksum
from .codecs import FRAME_ALIGN, ZSTD_HEADER_MAX, check_zstd_header, cpu_can_decode, frame_bounds, frame_offsets
from .defaults import CPU_IO_THREADS, ZSTD_LEVEL
from .errors import CodecUnavailableError
from .ring import Completion
from .storage import pwrite_all


class CpuCodecs:
    """raw and zstd on host memory. zstandard releases the GIL, so the ring overlaps it with I/O."""

    def __init__(self):
        self._c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
        self._d = zstandard.ZstdDecompressor()

    def encode(self, spec: dict, src: np.ndarray, out: np.ndarray) -> tuple[int, list | None]:
        """Compress src into out: (stored length, frame lengths), or (-1, None) if it would not shrink."""
        if spec["name"] != "zstd":
            return -1, None
        pos, frames = 0, []
        for o, n in frame_bounds(len(src), spec["frame_bytes"]):
            start = (pos + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN
            data = self._c.compress(src[o:o + n])
            if start + len(data) >= len(src):
                return -1, None
            out[pos:start] = 0
            out[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            pos = start + len(data)
            frames.append(len(data))
        return pos, frames

    def decode(self, spec: dict, stored: np.ndarray, out: np.ndarray, frames: list | None) -> None:
        if spec["name"] != "zstd":
            raise CodecUnavailableError(f"no CPU decoder for codec {spec['name']!r}")
        for (o, n), pos, clen in zip(frame_bounds(len(out), spec["frame_bytes"]), frame_offsets(frames), frames):
            check_zstd_header(stored[pos:pos + min(clen, ZSTD_HEADER_MAX)], n)
            data = self._d.decompress(stored[pos:pos + clen], max_output_size=n)
            if len(data) != n:
                raise ValueError(f"zstd frame decoded to {len(data)} bytes, expected {n}")
            out[o:o + n] = np.frombuffer(data, dtype=np.uint8)


class HostFile:
    """Chunk I/O for the CPU backend: os.pwrite / os.pread on `threads` workers."""

    def __init__(self, path: Path, mode: str, threads: int = CPU_IO_THREADS):
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if mode == "w" else os.O_RDONLY
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o666)  # less the umask, as open() does
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdsckpt-io")

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._pool.submit(self._pwrite, buf, nbytes, offset).result)

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._pool.submit(self._pread, buf, nbytes, offset).result)

    def _pwrite(self, buf, nbytes, offset) -> int:
        pwrite_all(self.fd, buf.numpy()[:nbytes], offset)
        return nbytes

    def _pread(self, buf, nbytes, offset) -> int:
        view = memoryview(buf.numpy()[:nbytes])
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CpuBackend:
    name = "cpu"
    io_path = "cpu"
    nvcomp_version = None

    def __init__(self, io_threads: int = CPU_IO_THREADS):
        self.io_threads = io_threads
        self._codecs = CpuCodecs()

    def can_decode(self, spec: dict) -> bool:
        return cpu_can_decode(spec)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def direct(self, view: torch.Tensor) -> bool:
        return view.device.type == "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def gatherer(self, plan, views):
        """(chunk, staging) -> the chunk's logical bytes: a view of its tensor where the chunk
        lies inside one, else its segments copied into `staging`."""
        def gather(chunk, staging: torch.Tensor) -> torch.Tensor:
            segs = chunk.segments
            if len(segs) == 1 and views.tensors[segs[0].tensor].device.type == "cpu":
                s = segs[0]
                return views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            for s in segs:
                staging[s.chunk_offset:s.chunk_offset + s.length].copy_(
                    views[s.tensor][s.tensor_offset:s.tensor_offset + s.length])
            return staging
        return gather

    def max_stored(self, spec: dict, nbytes: int) -> int:
        return nbytes  # anything larger is stored raw instead

    def encode(self, spec, src, out, scratch):
        return self._codecs.encode(spec, src.numpy(), out.numpy())

    def decode(self, spec, stored, out, frames) -> None:
        self._codecs.decode(spec, stored.numpy(), out.numpy(), frames)

    def checksum(self, buf: torch.Tensor) -> int:
        return checksum(buf.numpy())

    def open(self, path: Path, mode: str) -> HostFile:
        return HostFile(path, mode, self.io_threads)

    def synchronize(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def memory(self) -> dict:
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
