"""Chunk records read ahead of the ring: a ChunkFile that, told which records a read will ask for
(`will_read`), reads them in file order by several threads, in large 4 KiB-aligned blocks, with
O_DIRECT where the file system allows it, into a window of host memory; the ring's `pread` then
copies each record from there into its slot with the backend's copy.

Why (defaults.READ_AHEAD_THREADS): the ring asks for a record only when one of its slots is free,
so the disk sees the requests of at most `depth` chunks, and between a chunk's read and the next
slot's turn, fewer. Read ahead, the disk sees `threads` requests at all times, as a plain
multi-threaded O_DIRECT reader of the whole file does; the window bounds the host memory this
takes. Records outside the plan (or read with none) are read on their own, when asked for.
"""

from __future__ import annotations

import bisect
import errno
import os
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import torch

from gdsckpt.errors import GdsckptError
from gdsckpt.format.file import ALIGN
from .interfaces import Bytes
from .ring import Completion
from gdsckpt.core.storage import open_direct

# Gaps between planned records up to this size are read through rather than skipped: one request
# instead of two, for at most this many bytes of nobody's.
_MERGE_GAP = 1 << 20


def _aligned(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """nbytes of host memory at a 4 KiB aligned address (O_DIRECT's). pinned: page-locked, from
    torch's caching host allocator (page aligned; kept for the process's next read)."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -base.data_ptr() % ALIGN
    return base[skip:skip + nbytes]


def _blocks(ranges: list[tuple[int, int]], block: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks that cover `ranges` (increasing offsets): 4 KiB aligned,
    at most `block` bytes each, gaps up to _MERGE_GAP read through."""
    spans: list[list[int]] = []
    for off, n in ranges:
        start = off - off % ALIGN
        if spans and start - spans[-1][1] <= _MERGE_GAP:
            spans[-1][1] = max(spans[-1][1], off + n)
        else:
            spans.append([start, off + n])
    out = []
    for start, end in spans:
        end = -(-end // ALIGN) * ALIGN
        out.extend((o, min(block, end - o)) for o in range(start, end, block))
    return out


class _Ahead:
    """One plan: the records in the order the ring takes them, the blocks that hold them, and
    a window of `window` block buffers, each block read as soon as its buffer is free (the ring
    has taken every record in the block that last held it, and that block's read is done).
    `window` None: as many as the widest record's blocks, plus one a thread."""

    def __init__(self, ranges: list[tuple[int, int]], block: int, threads: int, read: Callable, pinned: bool,
                 window: int | None = None):
        self.blocks = _blocks(ranges, block)
        self._block, self._threads = block, threads
        self.ranges, self.spans = ranges, self._spans(ranges)
        self.asked = 0  # ranges a pread has asked for
        self.next = 0  # ranges taken (copied out): in the order asked
        self.window = min(len(self.blocks), window or self._needs(self.spans))
        # Each buffer is allocated by the first read into it, on a reader thread, beside the other
        # reads (page-locking 64 MiB takes milliseconds); as large as the largest block.
        self.host: list[torch.Tensor | None] = [None] * self.window
        self._size, self._pinned = max(n for _, n in self.blocks), pinned
        self._read = read
        self.futures: dict[int, Future] = {}
        self.released = 0  # blocks below this are done with; block b may be read once b < released + window
        for b in range(self.window):
            self._submit(b)

    def _spans(self, ranges) -> list[tuple[int, int]]:
        """Each range's first and last block."""
        starts = [o for o, _ in self.blocks]
        return [(bisect.bisect_right(starts, off) - 1, bisect.bisect_right(starts, off + n - 1) - 1)
                for off, n in ranges]

    def _needs(self, spans) -> int:
        """The window that reads `spans` at full speed: the widest record's blocks, and one a thread."""
        return max(last - first + 1 for first, last in spans) + self._threads

    def adopt(self, ranges: list[tuple[int, int]]) -> bool:
        """Take `ranges` as the records this plan's preads ask for, keeping the reads in flight,
        where none was asked for yet, the blocks that hold them are this plan's, and the window
        suits them; else False (nothing changed)."""
        if self.asked or _blocks(ranges, self._block) != self.blocks:
            return False
        spans = self._spans(ranges)
        if min(len(self.blocks), self._needs(spans)) > self.window:
            return False
        self.ranges, self.spans = ranges, spans
        return True

    def _submit(self, b: int) -> None:
        if b < len(self.blocks):
            off, n = self.blocks[b]
            self.futures[b] = self._read(lambda k=b % self.window, n=n: self._buffer(k)[:n], off)

    def _buffer(self, k: int) -> torch.Tensor:
        if self.host[k] is None:  # no other thread uses buffer k until this read is done
            self.host[k] = _aligned(self._size, self._pinned)
        return self.host[k]

    def take(self, j: int, buf: Bytes, copy, timings: dict) -> int:
        """Copy planned record j, the next one, into buf; the bytes there were (fewer only at the
        file's end)."""
        if j != self.next:
            raise GdsckptError(f"read ahead: record {j} waited for before record {self.next}")
        offset, nbytes = self.ranges[j]
        first, last = self.spans[j]
        got = 0
        for b in range(first, last + 1):
            boff, _ = self.blocks[b]
            t = time.perf_counter()
            have = self.futures[b].result()  # bytes of the block that the file had
            lo, hi = max(offset + got, boff), min(offset + nbytes, boff + have)
            t1 = time.perf_counter()
            if hi > lo:
                copy(buf[got:got + hi - lo], self.host[b % self.window][lo - boff:hi - boff])
                got += hi - lo
            timings["read_ahead_copy"] += time.perf_counter() - t1
            timings["read_ahead_wait"] += t1 - t
            if offset + got < min(offset + nbytes, boff + self.blocks[b][1]):
                break  # the file ended inside this block
        self.next += 1
        keep = self.spans[self.next][0] if self.next < len(self.ranges) else len(self.blocks)
        t = time.perf_counter()
        for b in range(self.released, keep):
            # A block that no record was waited for in (a gap's read through, a block past the
            # file's end) may still be being read into buffer b % window: done before the next
            # block's read into it. The others are done already.
            wait([self.futures.pop(b)])
            self._submit(b + self.window)
        timings["read_ahead_wait"] += time.perf_counter() - t
        self.released = max(self.released, keep)
        return got

    def stop(self) -> None:
        """Cancel the reads not started, wait for those that were: their buffer is the window."""
        for f in self.futures.values():
            f.cancel()
        for f in self.futures.values():
            if not f.cancelled():
                try:
                    f.result()
                except Exception:
                    pass
        self.futures.clear()


class ReadAheadFile:
    """A checkpoint file opened for the ring's reads (ring.ReadsAhead): see the module's doc.
    `copy(dst, src)` moves bytes from host memory into the ring's buffers (the backend's copy: set
    before the first pread, by the source once it knows the ring's backend);
    pinned: the window page-locked, which a copy into GPU memory reads at the DMA engines' rate;
    `label` names the file in errors (`path` may be /proc/self/fd/N)."""

    def __init__(self, path: Path, copy: Callable[[Bytes, Bytes], None] | None = None, *, threads: int, block: int,
                 pinned: bool = False, label=None):
        self.label = path if label is None else label  # names the file in errors
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._dfd = open_direct(path, os.O_RDONLY)
        self.direct = self._dfd >= 0  # False once the file system refused O_DIRECT, at open or at a read
        self.copy, self._threads, self._block, self._pinned = copy, threads, block, pinned
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdsckpt-read-ahead")
        self._ahead: _Ahead | None = None
        self._expected_at: float | None = None  # when `expect` began reading, until a plan takes it over
        # seconds the ring's preads waited for blocks to be read, and copied them out: in the read's stats
        self.stages: dict[str, float] = defaultdict(float)

    @property
    def io_path(self) -> str:
        return "read-ahead-direct" if self.direct else "read-ahead-buffered"

    def will_read(self, ranges: list[tuple[int, int]]) -> None:
        """The records (offset, stored bytes) the next preads ask for, in that order; replaces any
        earlier plan (an `expect`ed one whose blocks these are goes on, its reads kept). Read ahead
        only where their offsets increase, as a checkpoint's records do."""
        ranges = list(ranges)
        if self._ahead is not None and ranges and self._ahead.adopt(ranges):
            if self._expected_at is not None:  # how long the disk had been read before the plan came
                self.stages["read_ahead_before_plan"] += time.perf_counter() - self._expected_at
                self._expected_at = None
            return
        self._stop()
        if ranges and all(a[0] + a[1] <= b[0] for a, b in zip(ranges, ranges[1:])):
            self._ahead = _Ahead(ranges, self._block, self._threads, self._read_block, self._pinned)

    def expect(self, start: int, end: int, widest: int) -> None:
        """Bytes [start, end) hold records of at most `widest` bytes that a plan still to be made
        will ask for, all and in file order (a whole restore, whose index is being parsed): read
        them ahead now, in the blocks such a plan reads, within the window it would take."""
        self._stop()
        if end > start:
            self._expected_at = time.perf_counter()
            window = -(-(widest + self._block - ALIGN) // self._block) + self._threads
            self._ahead = _Ahead([(start, end - start)], self._block, self._threads, self._read_block,
                                 self._pinned, window)

    def pread(self, buf: Bytes, nbytes: int, offset: int) -> Completion:
        ahead = self._ahead
        if ahead is not None and ahead.asked < len(ahead.ranges) and ahead.ranges[ahead.asked] == (offset, nbytes):
            j, ahead.asked = ahead.asked, ahead.asked + 1
            return Completion(lambda: ahead.take(j, buf, self.copy, self.stages))
        # Not in the plan: this record alone, read now into its own buffer
        start = offset - offset % ALIGN
        host = _aligned(-(-(offset + nbytes - start) // ALIGN) * ALIGN)
        fut = self._read_block(lambda: host, start)

        def finish() -> int:
            got = max(0, min(nbytes, fut.result() - (offset - start)))
            self.copy(buf[:got], host[offset - start:offset - start + got])
            return got
        return Completion(finish)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError("a read-ahead file is opened for reading")

    def _read_block(self, into: Callable[[], torch.Tensor], offset: int) -> Future:
        return self._pool.submit(self._read_into, into, offset)

    def _read_into(self, into: Callable[[], torch.Tensor], offset: int) -> int:
        """Fill the buffer `into()` gives from `offset` (fewer bytes only at the file's end); the bytes read."""
        view = memoryview(into().numpy())
        done = 0
        try:
            while done < len(view):
                if self.direct:
                    try:
                        n = os.preadv(self._dfd, [view[done:]], offset + done)
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        # O_DIRECT refused at the read (an alignment the file system wants): buffered from here on
                        self.direct = False
                        continue
                    if n % ALIGN:  # O_DIRECT reads whole 4 KiB pages but the file's last
                        return done + n
                else:
                    n = os.preadv(self.fd, [view[done:]], offset + done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            e.add_note(f"gdsckpt: reading {self.label} at byte {offset + done}")
            raise
        return done

    def _stop(self) -> None:
        self._expected_at = None
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

    def close(self) -> None:
        self._stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self._dfd, self.fd):
            if fd >= 0:
                os.close(fd)
        self._dfd = self.fd = -1
