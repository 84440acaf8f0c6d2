"""zstd on host memory (zstandard), on the CPU backend's codec threads: byte shuffle and unshuffle
(FORMAT.md, "shuffle"), frames that do not pay written as raw zstd blocks, large frames on zstd's
own workers. The bytes are standard zstd frames in the framed layout (codecs/base.py), the same
that nvCOMP writes and reads for unshuffled chunks."""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

import numpy as np

from gdsckpt.core.defaults import CPU_MIN_SAVING, ZSTD_SHUFFLED_PARAMS
from .base import FRAME_ALIGN, Threads, frame_bounds, frame_offsets

if TYPE_CHECKING:
    import zstandard


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


class ZstdCpu:
    """zstd (optionally byte-shuffled) on host memory, on the CPU backend's codec threads: a
    chunk's shuffle, unshuffle and frame decodes are spread over them (numpy's copies and
    zstandard release the GIL), a large frame compresses on as many zstd workers. The ring
    overlaps the whole with the previous chunk's pwrite. The CPU backend checks the frame headers
    before decode (Zstd.check_stored)."""

    SAMPLES, SAMPLE_BYTES = 4, 4 << 10
    MT_FRAME_BYTES = 1 << 20  # frames from this size up compress on zstd's own worker threads
    PLANES = True  # _encode_planes where frames are whole pieces of planes (tests compare it with the general path)

    def __init__(self, threads: Threads, min_saving: float = CPU_MIN_SAVING):
        self._threads, self._min_saving = threads, min_saving
        self._local = threading.local()  # a zstd context per thread: contexts are not thread-safe
        self._buf = np.empty(0, dtype=np.uint8)

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
            import zstandard  # here, not at the top: the registry (format parsing) imports this module

            params = zstandard.ZstdCompressionParameters.from_level(
                level, threads=workers, **(ZSTD_SHUFFLED_PARAMS if shuffled else {}))
            c = cs[key] = zstandard.ZstdCompressor(compression_params=params)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            import zstandard  # as in _compressor

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
        width = spec.get("shuffle", 1)
        if self.PLANES and width > 1 and len(src) % width == 0 and (len(src) // width) % spec["frame_bytes"] == 0:
            return self._encode_planes(spec, src, out, width)
        if width > 1:
            data = self._scratch(len(src))
            self._threads.map(lambda rows: shuffle_bytes(src, width, data, rows),
                              _rows(len(src) // width, self._threads.count))
        else:
            data = src
        level, shuffled = spec["level"], width > 1
        probe = self._compressor(level, shuffled)
        pos, frames = 0, []
        for o, n in frame_bounds(len(data), spec["frame_bytes"]):
            frame = data[o:o + n]
            blob = None
            if self._pays(probe, frame):
                count = self._threads.count
                workers = count if n >= self.MT_FRAME_BYTES and count > 1 else 0
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
        workers = self._threads.count if sum(pays) == 1 and fb >= self.MT_FRAME_BYTES else 0

        def compress(k):
            buf = scratch[k * fb:(k + 1) * fb]
            np.copyto(buf, views[k])
            return self._compressor(level, True, workers).compress(buf)

        pool = self._threads.pool
        if pool is not None:
            futures = {k: pool.submit(compress, k) for k, p in enumerate(pays) if p}
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
        """Decode a chunk whose frames passed Zstd.check_stored (their count and headers)."""
        width = spec.get("shuffle", 1)
        dst = self._scratch(len(out)) if width > 1 else out
        bounds = frame_bounds(len(out), spec["frame_bytes"])

        def one(job):
            (o, n), pos, clen = job
            data = self._decompressor().decompress(stored[pos:pos + clen], max_output_size=n)
            if len(data) != n:
                raise ValueError(f"zstd frame decoded to {len(data)} bytes, expected {n}")
            dst[o:o + n] = np.frombuffer(data, dtype=np.uint8)

        self._threads.map(one, list(zip(bounds, frame_offsets(frames), frames)))
        if width > 1:
            self._threads.map(lambda rows: unshuffle_bytes(dst, width, out, rows),
                              _rows(len(out) // width, self._threads.count))
