"""The CPU backend: numpy views of host tensors, zstd (zstandard) and raw codecs, os.pwrite /
os.pread on a small thread pool. It runs wherever there is no GPU, CI included, and reads any
chunk that has a CPU decoder.

Host bytes move with numpy, not torch: torch's copy_ splits even a 1 KiB copy across its
intra-op threads, and on a busy 2-core machine each split waited for a core (a 350 MB gather
took 0.9-4 s through copy_, 0.04-0.07 s through numpy; bench/results/2026-11-23-cpu-compare/)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from .checksum import ALGORITHMS
from .codecs import FRAME_ALIGN, ZSTD_HEADER_MAX, check_zstd_header, cpu_can_decode, frame_bounds, frame_offsets
from .defaults import CPU_CODEC_THREADS, CPU_DIRECT_IO, CPU_IO_THREADS, CPU_MIN_SAVING, CPU_WRITEBACK, ZSTD_SHUFFLED_PARAMS
from .errors import CodecUnavailableError
from .ring import Completion
from .storage import pwrite_all


def _rows(m: int, parts: int):
    """[r0, r1) element ranges splitting m elements into `parts` pieces for the codec threads."""
    step = -(-m // parts) if m else 1
    return [(r, min(m, r + step)) for r in range(0, m, step)] or [(0, 0)]


def shuffle_bytes(src: np.ndarray, width: int, out: np.ndarray, rows=None) -> np.ndarray:
    """FORMAT.md's byte shuffle of `src` into `out`: byte plane 0 (byte 0 of every `width`-byte
    element), then plane 1, ..., then the len(src) % width tail bytes as they are. Grouping the
    exponent bytes of floats lets zstd find them (ZipNN's observation). `rows` = (r0, r1): only
    elements r0..r1-1 (one codec thread's share). Returns out[:len(src)]."""
    n = len(src)
    m = n // width
    r0, r1 = rows or (0, m)
    elems = src[r0 * width:r1 * width].reshape(-1, width)
    for p in range(width):  # plane by plane: 3.4 GB/s, where one transposed copy ran at 0.6-1 GB/s back
        np.copyto(out[p * m + r0:p * m + r1], elems[:, p])
    if r1 == m:
        out[m * width:n] = src[m * width:]
    return out[:n]


def unshuffle_bytes(src: np.ndarray, width: int, out: np.ndarray, rows=None) -> None:
    """The inverse of shuffle_bytes: `out` (len(src) bytes) gets the original element order back."""
    n = len(src)
    m = n // width
    r0, r1 = rows or (0, m)
    elems = out[r0 * width:r1 * width].reshape(-1, width)
    for p in range(width):
        np.copyto(elems[:, p], src[p * m + r0:p * m + r1])
    if r1 == m:
        out[m * width:n] = src[m * width:]


_RAW_BLOCK = 128 << 10  # zstd's largest block
_RAW_HEAD = 9  # magic, frame header descriptor, 4-byte content size


def raw_frame_size(n: int) -> int:
    return _RAW_HEAD + n + 3 * max(1, -(-n // _RAW_BLOCK))


def write_raw_frame(data: np.ndarray, out: np.ndarray) -> None:
    """`data` (0 < n < 4 GiB bytes) as one standard zstd frame of raw blocks (RFC 8878, 3.1.1),
    into out[:raw_frame_size(n)]: what zstd itself emits for bytes it cannot shrink, made with a
    copy instead of a compressor run. Single-segment header with a 4-byte content size, no
    checksum; each block a 3-byte header (last-block bit, type 0 = raw, size) and its bytes."""
    n = len(data)
    out[:_RAW_HEAD] = np.frombuffer(struct.pack("<IBI", 0xFD2FB528, 0xA0, n), dtype=np.uint8)
    full, rest = divmod(n, _RAW_BLOCK)
    if full:
        body = out[_RAW_HEAD:_RAW_HEAD + full * (_RAW_BLOCK + 3)].reshape(full, _RAW_BLOCK + 3)
        body[:, :3] = np.frombuffer((_RAW_BLOCK << 3).to_bytes(3, "little"), dtype=np.uint8)
        np.copyto(body[:, 3:], data[:full * _RAW_BLOCK].reshape(full, _RAW_BLOCK))
        if not rest:
            body[-1, 0] |= 1
    if rest:
        at = _RAW_HEAD + full * (_RAW_BLOCK + 3)
        out[at:at + 3] = np.frombuffer(((rest << 3) | 1).to_bytes(3, "little"), dtype=np.uint8)
        out[at + 3:at + 3 + rest] = data[full * _RAW_BLOCK:]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _place_frame(out: np.ndarray, pos: int, frame, blob: bytes | None, limit: int, frames: list) -> int:
    """Put one frame after `pos` at the next 16-byte boundary (FORMAT.md; the gap zeroed): the
    compressed `blob`, or `frame` as raw zstd blocks where blob is None. Returns the end, or -1
    once the chunk would reach `limit` bytes (it does not shrink: the caller stores it raw)."""
    start = (pos + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN
    size = raw_frame_size(len(frame)) if blob is None else len(blob)
    if start + size >= limit:
        return -1
    out[pos:start] = 0
    if blob is None:
        write_raw_frame(frame, out[start:start + size])
    else:
        out[start:start + size] = np.frombuffer(blob, dtype=np.uint8)
    frames.append(size)
    return start + size


class CpuCodecs:
    """raw and zstd (optionally byte-shuffled) on host memory, on `threads` cores: a chunk's
    shuffle, unshuffle and frame decodes are spread over a pool of that many threads (numpy's
    copies and zstandard release the GIL), a large frame compresses on as many zstd workers.
    The ring overlaps the whole with the previous chunk's pwrite."""

    SAMPLES, SAMPLE_BYTES = 4, 4 << 10
    MT_FRAME_BYTES = 1 << 20  # frames from this size up compress on zstd's own worker threads
    PLANES = True  # _encode_planes where frames are whole pieces of planes (tests compare it with the general path)

    def __init__(self, threads: int = CPU_CODEC_THREADS, min_saving: float = CPU_MIN_SAVING):
        self._threads, self._min_saving = max(1, threads), min_saving
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gdsckpt-codec") if self._threads > 1 else None
        self._local = threading.local()  # a zstd context per thread: contexts are not thread-safe
        self._buf = np.empty(0, dtype=np.uint8)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _map(self, fn, items) -> list:
        """[fn(x) for x in items], the items dealt round-robin to the threads (one task each:
        a pool task costs ~50 us, a frame's work 0.1-3 ms)."""
        items = list(items)
        k = self._threads
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        parts = list(self._pool.map(lambda j: [fn(x) for x in items[j::k]], range(min(k, len(items)))))
        out = [None] * len(items)
        for j, part in enumerate(parts):
            out[j::k] = part
        return out

    def _scratch(self, n: int) -> np.ndarray:
        if len(self._buf) < n:
            self._buf = np.empty(n, dtype=np.uint8)
        return self._buf[:n]

    def _compressor(self, level: int, shuffled: bool, workers: int = 0) -> zstandard.ZstdCompressor:
        """A zstd context for this thread: `level`'s, with the match finder of
        defaults.ZSTD_SHUFFLED_PARAMS for byte planes; `workers` > 0: zstd's own threads split
        the frame into jobs (one frame then compresses on several cores)."""
        cs = self._local.__dict__.setdefault("c", {})
        key = (level, shuffled, workers)
        c = cs.get(key)
        if c is None:
            params = zstandard.ZstdCompressionParameters.from_level(
                level, threads=workers, **(ZSTD_SHUFFLED_PARAMS if shuffled else {}))
            c = cs[key] = zstandard.ZstdCompressor(compression_params=params)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def _pays(self, comp: zstandard.ZstdCompressor, frame: np.ndarray) -> bool:
        """Whether compressing `frame` is worth its CPU time: samples spread over it (a frame
        may span several byte planes) must save at least `min_saving` together. A frame of
        mantissa bytes fails, and is stored in raw blocks for the price of a copy (most of an fp32
        chunk, once shuffled, where a frame is a plane)."""
        k, size = self.SAMPLES, self.SAMPLE_BYTES
        if self._min_saving <= 0 or len(frame) < 4 * k * size:
            return True
        step = len(frame) // k
        got = sum(len(comp.compress(np.ascontiguousarray(frame[i * step + (step - size) // 2:][:size])))
                  for i in range(k))
        return got <= (1 - self._min_saving) * k * size

    def encode(self, spec: dict, src: np.ndarray, out: np.ndarray) -> tuple[int, list | None]:
        """Compress src into out: (stored length, frame lengths), or (-1, None) to store it raw
        (it would not shrink). Frames that would not shrink enough hold raw blocks."""
        if spec["name"] != "zstd":
            return -1, None
        width = spec.get("shuffle", 1)
        if self.PLANES and width > 1 and len(src) % width == 0 and (len(src) // width) % spec["frame_bytes"] == 0:
            return self._encode_planes(spec, src, out, width)
        if width > 1:
            data = self._scratch(len(src))
            self._map(lambda rows: shuffle_bytes(src, width, data, rows), _rows(len(src) // width, self._threads))
        else:
            data = src
        level, shuffled = spec["level"], width > 1
        probe = self._compressor(level, shuffled)
        pos, frames = 0, []
        for o, n in frame_bounds(len(data), spec["frame_bytes"]):
            frame = data[o:o + n]
            blob = None
            if self._pays(probe, frame):
                workers = self._threads if n >= self.MT_FRAME_BYTES and self._threads > 1 else 0
                blob = self._compressor(level, shuffled, workers).compress(frame)
            pos = _place_frame(out, pos, frame, blob, len(data), frames)
            if pos < 0:
                return -1, None
        return pos, frames

    def _encode_planes(self, spec: dict, src: np.ndarray, out: np.ndarray, width: int) -> tuple[int, list | None]:
        """encode() of a shuffled chunk whose frames are whole pieces of byte planes (a full chunk:
        16 MiB of fp32 is 4 planes of 4 MiB, one frame each). The same bytes as shuffling it all
        and then compressing, with less work: a frame that does not pay is copied straight from
        the chunk's strided plane into its raw blocks (one pass, not shuffle + copy), and the frames
        that pay are shuffled and compressed on the codec threads meanwhile."""
        fb, m = spec["frame_bytes"], len(src) // width
        level, probe = spec["level"], self._compressor(spec["level"], True)
        elems = src.reshape(m, width)
        views = [elems[o % m:o % m + fb, o // m] for o in range(0, len(src), fb)]  # frame k's bytes, strided
        pays = [self._pays(probe, v) for v in views]
        scratch = self._scratch(len(src))
        workers = self._threads if sum(pays) == 1 and fb >= self.MT_FRAME_BYTES else 0

        def compress(k):
            buf = scratch[k * fb:(k + 1) * fb]
            np.copyto(buf, views[k])
            return self._compressor(level, True, workers).compress(buf)

        if self._pool is not None:
            futures = {k: self._pool.submit(compress, k) for k, p in enumerate(pays) if p}
            result = lambda k: futures[k].result()  # noqa: E731
        else:
            futures, result = {}, compress
        pos, frames = 0, []
        try:
            for k, view in enumerate(views):
                pos = _place_frame(out, pos, view, result(k) if pays[k] else None, len(src), frames)
                if pos < 0:
                    return -1, None
        finally:  # scratch is the next chunk's: no compression may still be reading it
            for f in futures.values():
                f.exception()
        return pos, frames

    def decode(self, spec: dict, stored: np.ndarray, out: np.ndarray, frames: list | None) -> None:
        if spec["name"] != "zstd":
            raise CodecUnavailableError(f"no CPU decoder for codec {spec['name']!r}")
        width = spec.get("shuffle", 1)
        dst = self._scratch(len(out)) if width > 1 else out
        bounds = frame_bounds(len(out), spec["frame_bytes"])
        if len(frames) != len(bounds):
            raise ValueError(f"{len(frames)} zstd frames recorded for {len(bounds)} frame bounds")
        for (o, n), pos, clen in zip(bounds, frame_offsets(frames), frames):
            check_zstd_header(stored[pos:pos + min(clen, ZSTD_HEADER_MAX)], n)

        def one(job):
            (o, n), pos, clen = job
            data = self._decompressor().decompress(stored[pos:pos + clen], max_output_size=n)
            if len(data) != n:
                raise ValueError(f"zstd frame decoded to {len(data)} bytes, expected {n}")
            dst[o:o + n] = np.frombuffer(data, dtype=np.uint8)

        self._map(one, list(zip(bounds, frame_offsets(frames), frames)))
        if width > 1:
            self._map(lambda rows: unshuffle_bytes(dst, width, out, rows), _rows(len(out) // width, self._threads))


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
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._dfd = -1
        self._owned = owned
        if mode == "w" and owned is not None and CPU_DIRECT_IO and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # tmpfs and a few others refuse O_DIRECT: buffered writes only
                self._dfd = -1
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
        try:
            pwrite_all(self._dfd, memoryview(view), offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return False  # rewritten buffered, from the start
        return True

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
        return cpu_can_decode(spec)

    def empty(self, nbytes: int) -> torch.Tensor:
        """nbytes at a 4 KiB aligned address, with room to round a write up to 4 KiB (HostFile's
        O_DIRECT writes)."""
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

    def gatherer(self, plan, views):
        """(chunk, staging) -> the chunk's logical bytes: a view of its tensor where the chunk
        lies inside one, else its segments copied into `staging`, split over the codec threads:
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

        def gather(chunk, staging: torch.Tensor) -> torch.Tensor:
            segs = chunk.segments
            if len(segs) == 1 and tensors[segs[0].tensor].is_cpu:
                s = segs[0]
                return views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            base = staging.data_ptr()
            half = next((k for k, s in enumerate(segs) if s.chunk_offset >= chunk.length // 2), len(segs))
            self._codecs._map(copy, [(base, staging, segs[:half]), (base, staging, segs[half:])])
            return staging
        return gather

    def max_stored(self, spec: dict, nbytes: int) -> int:
        return nbytes  # anything larger is stored raw instead

    def encode(self, spec, src, out, scratch):
        return self._codecs.encode(spec, _np(src), _np(out))

    def decode(self, spec, stored, out, frames) -> None:
        self._codecs.decode(spec, _np(stored), _np(out), frames)

    def checksum(self, buf: torch.Tensor, algorithm: str) -> int:
        return ALGORITHMS[algorithm](_np(buf))

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
