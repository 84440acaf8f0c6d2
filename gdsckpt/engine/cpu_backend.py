"""The CPU backend: numpy views of host tensors, each codec's CPU coder (zstd's: codecs/zstd_cpu.py),
os.pwrite / os.pread on a small thread pool. It runs wherever there is no GPU, CI included, and reads any
chunk that has a CPU decoder.

Host bytes move with numpy, not torch: torch's copy_ splits even a 1 KiB copy across its
intra-op threads, and on a busy 2-core machine each split waited for a core (a 350 MB gather
took 0.9-4 s through copy_, 0.04-0.07 s through numpy; bench/results/2026-11-23-cpu-compare/)."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gdsckpt import codecs
from gdsckpt.format.checksum import ALGORITHMS
from gdsckpt.codecs.base import CpuCoder
from gdsckpt.core.defaults import CPU_CODEC_THREADS, CPU_DIRECT_IO, CPU_IO_THREADS, CPU_WRITEBACK
from gdsckpt.errors import CodecUnavailableError
from .ring import ChecksumList, Completion
from gdsckpt.core.storage import open_direct, pwrite_all, pwrite_direct


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class CodecThreads:
    """The CPU backend's codec threads (codecs.base.Threads): CPU coders spread a chunk's work over
    them (numpy's copies and zstandard release the GIL), and the gather splits its copies."""

    def __init__(self, count: int):
        self.count = max(1, count)
        self.pool = ThreadPoolExecutor(self.count, thread_name_prefix="gdsckpt-codec") if self.count > 1 else None

    def map(self, fn, items) -> list:
        """[fn(x) for x in items], the items dealt round-robin to the threads (one task each:
        a pool task costs ~50 us, a frame's work 0.1-3 ms)."""
        items = list(items)
        k = self.count
        if self.pool is None or len(items) < 2:
            return [fn(x) for x in items]
        parts = list(self.pool.map(lambda j: [fn(x) for x in items[j::k]], range(min(k, len(items)))))
        out = [None] * len(items)
        for j, part in enumerate(parts):
            out[j::k] = part
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class CpuCodecs:
    """Encode and decode on the CPU: each codec's own CPU coder (the registry's Codec.cpu_coder),
    made on first use, all on one set of `threads` codec threads."""

    def __init__(self, threads: int = CPU_CODEC_THREADS):
        self.threads = CodecThreads(threads)
        self._coders: dict[str, CpuCoder | None] = {}

    def coder(self, spec: dict) -> CpuCoder | None:
        """The CPU coder of spec's codec, or None where the codec has none."""
        name = spec["name"]
        if name not in self._coders:
            self._coders[name] = codecs.of(spec).cpu_coder(self.threads)
        return self._coders[name]

    def encode(self, spec: dict, src: np.ndarray, out: np.ndarray) -> tuple[int, list | None]:
        """(stored length, frame lengths) with the stored bytes in `out`, or (-1, None): store the
        chunk raw (it would not shrink, or its codec has no CPU encoder: raw)."""
        coder = self.coder(spec)
        return (-1, None) if coder is None else coder.encode(spec, src, out)

    def decode(self, spec: dict, stored: np.ndarray, out: np.ndarray, frames: list | None) -> None:
        """`out` gets the chunk's logical bytes; the codec's checks of the stored bytes come first."""
        coder = self.coder(spec)
        if coder is None:
            raise CodecUnavailableError(f"no CPU decoder for codec {spec['name']!r}")
        codecs.of(spec).check_stored(stored, spec, len(out), frames)
        coder.decode(spec, stored, out, frames)

    def close(self) -> None:
        self.threads.close()




def _sync_file_range():
    """libc's sync_file_range (Linux), or None. Python's os module does not wrap it."""
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return f


_SYNC_FILE_RANGE = _sync_file_range() if CPU_WRITEBACK else None
_memmove = ctypes.memmove  # releases the GIL
_SYNC_FILE_RANGE_WRITE = 2


_DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of this (records are 4 KiB aligned)


class HostFile:
    """Chunk I/O for the CPU backend: os.pwrite / os.pread on `threads` workers.

    Writes of buffers the backend allocated (its ring slots: `owned(buf)` gives the bytes that
    may be written from buf's address) go through a second, O_DIRECT descriptor, rounded up to
    4 KiB with zeros (the padding up to the next record, which the format leaves zero): the disk
    reads them straight from the slot, with no copy into the page cache and nothing left for the
    final fsync. Anything else (a raw chunk written from the caller's tensor), a file system
    without O_DIRECT (tmpfs) and any EINVAL fall back to buffered writes, whose write-back starts
    at once (sync_file_range, where there is one), so that the disk works while the next chunks
    compress instead of all at once in the final fsync."""

    def __init__(self, path: Path, mode: str, threads: int = CPU_IO_THREADS, owned=None):
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if mode == "w" else os.O_RDONLY
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o666)  # less the umask, as torch.save's
        self._owned = owned
        self._dfd = open_direct(path) if mode == "w" and owned is not None and CPU_DIRECT_IO else -1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdsckpt-io")

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._pool.submit(self._pwrite, buf, nbytes, offset).result)

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._pool.submit(self._pread, buf, nbytes, offset).result)

    def _pwrite(self, buf, nbytes, offset) -> int:
        if self._dfd >= 0 and self._write_direct(buf, nbytes, offset):
            return nbytes
        pwrite_all(self.fd, _np(buf)[:nbytes], offset)
        if _SYNC_FILE_RANGE is not None:  # a hint: the fsync at the commit is what makes it durable
            _SYNC_FILE_RANGE(self.fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
        return nbytes

    def _write_direct(self, buf, nbytes: int, offset: int) -> bool:
        """Write buf[:nbytes] and zeros up to the next 4 KiB through O_DIRECT; False where that
        cannot be done (the caller then writes it buffered)."""
        rounded = -(-nbytes // _DIRECT_ALIGN) * _DIRECT_ALIGN
        addr = buf.data_ptr()
        if offset % _DIRECT_ALIGN or addr % _DIRECT_ALIGN or self._owned(buf) < rounded:
            return False
        view = (ctypes.c_char * rounded).from_address(addr)  # buf's slot: it outlives this write
        ctypes.memset(addr + nbytes, 0, rounded - nbytes)
        return pwrite_direct(self._dfd, memoryview(view), offset)  # False: rewritten buffered, from the start

    def _pread(self, buf, nbytes, offset) -> int:
        view = memoryview(_np(buf)[:nbytes])
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
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
        self._buffers: dict[int, tuple] = {}  # storage address -> (buffer from empty(), end of its room)

    def can_decode(self, spec: dict) -> bool:
        return codecs.cpu_can_decode(spec)

    def empty(self, nbytes: int, *, once: bool = False) -> torch.Tensor:
        """nbytes at a 4 KiB aligned address, with room to round a write up to 4 KiB (HostFile's
        O_DIRECT writes). `once` changes nothing here: host memory goes back as it is freed."""
        room = -(-nbytes // _DIRECT_ALIGN) * _DIRECT_ALIGN
        base = torch.empty(room + _DIRECT_ALIGN, dtype=torch.uint8)
        skip = -base.data_ptr() % _DIRECT_ALIGN
        self._buffers[base.untyped_storage().data_ptr()] = (base, base.data_ptr() + skip + room)  # kept alive
        return base[skip:skip + nbytes]

    def _owned(self, buf: torch.Tensor) -> int:
        """Bytes from buf's address to the end of the buffer it lies in, if this backend made it; else 0."""
        owner = self._buffers.get(buf.untyped_storage().data_ptr()) if buf.is_cpu else None
        return owner[1] - buf.data_ptr() if owner else 0

    def direct(self, view: torch.Tensor) -> bool:
        return view.device.type == "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_cpu and src.is_cpu and dst.is_contiguous() and src.is_contiguous() and dst.nbytes == src.nbytes:
            _memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)  # the restore's scatter: ~3,600 small copies
        elif dst.is_cpu and src.is_cpu:
            np.copyto(_np(dst), _np(src))
        else:  # a CUDA tensor saved or loaded through the CPU backend
            dst.copy_(src)

    def scatter(self, copies) -> None:
        for dst, src in copies:
            self.copy(dst, src)

    def gatherer(self, plan, views):
        """(chunk, staging, spec) -> (the chunk's logical bytes, False): a view of its tensor where the
        chunk lies inside one, else its segments copied into `staging`, split over the codec threads:
        by pointer (memmove) from plain host tensors, which costs ~1 us a segment where a torch
        view costs ~50 (a 350 MB AdamW state has ~3,600 tensors), else through the byte view."""
        tensors = views.tensors
        ptrs: dict[int, int] = {}  # tensor -> address of its bytes; 0: not a plain host tensor

        def ptr(i: int) -> int:
            p = ptrs.get(i)
            if p is None:
                p = ptrs[i] = tensors[i].data_ptr() if tensors[i].is_cpu and views.plain(i) else 0
            return p

        def copy(job):
            base, staging, segs = job
            for s in segs:
                p = ptr(s.tensor)
                if p:
                    _memmove(base + s.chunk_offset, p + s.tensor_offset, s.length)
                else:
                    staging[s.chunk_offset:s.chunk_offset + s.length].copy_(
                        views[s.tensor][s.tensor_offset:s.tensor_offset + s.length])

        def gather(chunk, staging: torch.Tensor, spec: dict) -> tuple[torch.Tensor, bool]:
            segs = chunk.segments  # (a shuffled codec shuffles as it compresses: codecs/zstd_cpu.py)
            if len(segs) == 1 and tensors[segs[0].tensor].is_cpu:
                s = segs[0]
                return views[s.tensor][s.tensor_offset:s.tensor_offset + s.length], False
            base = staging.data_ptr()
            half = next((k for k, s in enumerate(segs) if s.chunk_offset >= chunk.length // 2), len(segs))
            self._codecs.threads.map(copy, [(base, staging, segs[:half]), (base, staging, segs[half:])])
            return staging, False
        return gather

    def max_stored(self, spec: dict, nbytes: int) -> int:
        return nbytes  # anything larger is stored raw instead

    def encode(self, spec, src, out, scratch, shuffled=False):
        return self._codecs.encode(spec, _np(src), _np(out))

    def decode(self, spec, stored, out, frames) -> None:
        self._codecs.decode(spec, _np(stored), _np(out), frames)

    def checksum(self, buf: torch.Tensor, algorithm: str) -> int:
        return ALGORITHMS[algorithm](_np(buf))

    def checksums(self, algorithm: str, count: int) -> ChecksumList:
        return ChecksumList(lambda buf: self.checksum(buf, algorithm))

    def open(self, path: Path, mode: str) -> HostFile:
        return HostFile(path, mode, self.io_threads, self._owned)

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
        self._codecs.close()
        return False
