"""One segment of the memory tier (gdsckpt/manager/memory/tier.py): a file in shared memory, mapped into
this process, holding one step's checkpoint image from offset 0, byte for byte the file it
becomes (header, 4 KiB-aligned chunk records, index, footer).

The mapping covers the size the slot was made with (the step's records and an allowance for the
index); an index that outgrows it goes through the file descriptor, so a slot never has to be
mapped again. The file is sparse: memory is taken by arenas of defaults.POOL_ARENA_BYTES as
bytes first reach them, like the pinned pool's growth, and taken with fallocate, so that a full
shared-memory file system is a MemoryTierFullError there and not a SIGBUS at a store into the
mapping. On a GPU host each arena is also page-locked (cudaHostRegister) as device-to-host
copies first reach it; arenas stay taken and locked while the slot lives in this process, so a
slot reused for later steps takes and locks nothing more. A slot made ahead of need
(Checkpointer.reserve) takes and locks all of them before any step uses it (`prepare`).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path

import torch

from gdsckpt.core.defaults import POOL_ARENA_BYTES
from gdsckpt.errors import MemoryTierFullError, MemoryTierTrustError
from .trust import untrusted_fd
from gdsckpt.core.storage import pread_exact, pwrite_all

log = logging.getLogger("gdsckpt.memory")


class Slot:
    """A segment file at `path`: made with `capacity` bytes (a sparse file: memory is taken only
    as bytes are written), or, capacity None, an existing one opened as it is."""

    def __init__(self, path: Path, capacity: int | None = None):
        create = capacity is not None
        flags = (os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
                 | (os.O_CREAT | os.O_EXCL if create else 0))
        fd = os.open(path, flags, 0o600)
        try:
            why = None if create else untrusted_fd(fd)
            if why is not None:  # never mapped, never read: another user's, or others may write it
                raise MemoryTierTrustError(f"the memory tier's segment {str(path)!r} is {why}: refused", path=path)
            if create:
                os.ftruncate(fd, capacity)
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size) if size else None
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        self.path, self.fd, self.mapped = path, fd, size
        # One export of the mapping, made once: every view below is a view of this tensor, so the
        # mapping can be closed once they are gone.
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self._mv = memoryview(self.tensor.numpy())
        self._taken: set[int] = set()  # arenas allocated (fallocate)
        self._pinned: dict[int, int] = {}  # arena index -> bytes page-locked
        self._pin_failed = False

    @property
    def name(self) -> str:
        return self.path.name

    def size(self) -> int:
        """The file's size: what the tier counts as held (an upper bound of the memory it takes)."""
        return os.fstat(self.fd).st_size

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    # ------------------------------------------------------------ bytes
    def write(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        inside = max(0, min(len(mv), self.mapped - offset))
        if inside:
            self._touch(offset, offset + inside, pin=False)
            self._mv[offset:offset + inside] = mv[:inside]
        if inside < len(mv):  # an index that outgrew the mapping: the file grows
            pwrite_all(self.fd, mv[inside:], offset + inside)

    def read(self, n: int, offset: int) -> bytes:
        inside = max(0, min(n, self.mapped - offset))
        data = self._mv[offset:offset + inside].tobytes() if inside else b""
        if inside < n:
            data += pread_exact(self.fd, n - inside, offset + inside)
        return data

    def zero(self, start: int, end: int) -> None:
        if end > start:
            self._touch(start, end, pin=False)
            self.tensor[start:end].zero_()

    def views(self, start: int, end: int) -> list[memoryview]:
        """memoryviews of the mapped bytes [start, end): what os.pwritev takes."""
        if end > self.mapped:
            raise ValueError(f"{self.path}: bytes {start}..{end} lie beyond the mapping ({self.mapped})")
        return [self._mv[start:end]]

    def host(self, start: int, end: int, pin: bool) -> tuple[list[torch.Tensor], float]:
        """Host uint8 tensors covering the mapped bytes [start, end), cut at arena boundaries (a
        device copy never spans two registrations), and the seconds spent taking (and, pin=True:
        the bytes come from a GPU, page-locking) arenas first reached now."""
        spent = self._touch(start, end, pin)
        out = []
        pos = start
        while pos < end:
            stop = min(end, (pos // POOL_ARENA_BYTES + 1) * POOL_ARENA_BYTES)
            out.append(self.tensor[pos:stop])
            pos = stop
        return out, spent

    def prepare(self, pin: bool, stop=None) -> bool:
        """Take (and with pin, page-lock) every arena of the mapping now, one at a time, asking
        stop() between them: a slot made ahead of need. Whether every arena was reached."""
        for lo in range(0, self.mapped, POOL_ARENA_BYTES):
            if stop is not None and stop():
                return False
            self._touch(lo, min(self.mapped, lo + POOL_ARENA_BYTES), pin)
        return True

    def _touch(self, start: int, end: int, pin: bool) -> float:
        """Take (and with pin, page-lock) the arenas under [start, end); seconds spent."""
        t = time.perf_counter()
        for arena in range(start // POOL_ARENA_BYTES, (end - 1) // POOL_ARENA_BYTES + 1 if end > start else 0):
            lo = arena * POOL_ARENA_BYTES
            n = min(POOL_ARENA_BYTES, self.mapped - lo)
            if arena not in self._taken:
                try:
                    os.posix_fallocate(self.fd, lo, n)
                except OSError as e:
                    raise MemoryTierFullError(f"the shared-memory file system holding {str(self.path)!r} has no "
                                              f"room for {n} more bytes ({e.strerror})") from None
                self._taken.add(arena)
            if pin and arena not in self._pinned and not self._pin_failed:
                self._pin(arena, lo, n)
        return time.perf_counter() - t

    def _pin(self, arena: int, lo: int, n: int) -> None:
        from gdsckpt.engine.gpu.host_register import register
        try:
            register(self.tensor.data_ptr() + lo, n)
        except RuntimeError as e:  # copies still work, from pageable memory: slower, synchronous
            self._pin_failed = True
            log.warning("gdsckpt: cannot page-lock the memory tier's segment %s (%s); device-to-host copies "
                        "into it will be synchronous", self.path, e)
            return
        self._pinned[arena] = n

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unmap (the file stays): page-locked arenas are unlocked first."""
        if self.fd < 0:
            return
        if self._pinned:
            from gdsckpt.engine.gpu.host_register import unregister
            for arena in list(self._pinned):
                try:
                    unregister(self.tensor.data_ptr() + arena * POOL_ARENA_BYTES)
                except RuntimeError as e:
                    log.warning("gdsckpt: unlocking %s: %s", self.path, e)
                del self._pinned[arena]
        self._mv.release()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            self._mm = None
        os.close(self.fd)
        self.fd = -1

    def delete(self) -> None:
        """Unmap and remove the file: its memory goes back to the system."""
        self.close()
        self.path.unlink(missing_ok=True)
