"""save_async's host pool: stored chunk bytes wait here between the GPU and the disk.

One pool per device per process (`pool_for`), allocated as saves need it and reused by every
later save. Memory comes in arenas: page-locked where the bytes come from a GPU, so the
device-to-host copies run asynchronously at full PCIe speed (plain pages faulted in, then
registered with CUDA: a 5 GB first pool in 1.3-2.6 s where CUDA's own pinned allocator took
2.4-3.5 s); plain host memory on the CPU backend, where the "copy" is a memcpy. The pool holds
stored bytes (what the codec emitted), not logical bytes, and grows only as they arrive, so what
it pins is about the stored size.

An extent (one chunk record, rounded up to 4 KiB) is one or more pieces of arenas, each
starting and ending on a 4 KiB boundary (what O_DIRECT asks of a buffer), taken first-fit in
address order, so that a chunk's pieces are usually one run and one write.

Bounded: a reservation names the most the pool may hold (`limit`); an extent that does not
fit waits until the background writer releases earlier ones (back-pressure), and the caller
is told how long it waited, for the save's stats.

Grown ahead of need (`grow`: gdsckpt.reserve) on a background thread, an arena at a time and
outside the lock, so that a save reserving meanwhile is never held up for longer than the
arena in progress; that arena counts in `growing`, and a save grows the pool only into what
is neither allocated nor being allocated: the two together stay within the bound.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import time

import torch

from gdsckpt.core.defaults import POOL_ARENA_BYTES

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT's alignment for offsets, lengths and buffers; also the file format's record alignment


_ZEROS = bytes(ALIGN)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _registered(size: int) -> torch.Tensor | None:
    """`size` bytes of anonymous memory (page-aligned, as cudaHostRegister and O_DIRECT want), every
    page faulted in by torch's fill threads, then page-locked with cudaHostRegister: 4 GB of
    arenas in 0.5-1.2 s on the H100's VMs (fresh memory the slower), where cudaHostAlloc (torch's
    pin_memory=True) took 1.9-3.2 s, and as fast a target for device-to-host copies
    (bench/results/2026-11-24-h100-first-pool/).
    None where the runtime refuses to register it. The tensor holds the mapping: it is unmapped
    with the last view of it. Not inherited by a forked child (a DataLoader worker), as
    cudaHostAlloc's memory is not: a child writing a page-locked page the parent shares
    copy-on-write would leave the parent's copies landing in the child's page."""
    from .gpu.host_register import register
    m = mmap.mmap(-1, size)
    m.madvise(mmap.MADV_DONTFORK)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(0)
    try:
        register(t.data_ptr(), size)
    except RuntimeError:
        return None
    return t


class _Arena:
    """One allocation; `free` is a sorted list of [start, end) byte ranges."""

    __slots__ = ("tensor", "mv", "size", "free", "registered")

    def __init__(self, size: int, pinned: bool):
        if pinned:
            t = _registered(size)
            self.registered = t is not None
            if t is None:  # cudaHostRegister refused: torch's pinned allocator, which rounds to a power of two
                t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            self.registered = False
            t = torch.empty(size + ALIGN, dtype=torch.uint8)
        skew = -t.data_ptr() % ALIGN  # mappings and cudaHostAlloc return whole pages; plain memory may not
        if skew or not pinned:
            t = t[skew:skew + (size if not pinned else size - ALIGN)]
        self.tensor = t
        self.size = t.numel()
        self.mv = memoryview(t.numpy()).cast("B")
        self.free = [[0, self.size]]

    def unlock(self) -> None:
        """Undo the page-locking of a registered arena leaving the pool (its memory goes back to the
        system with the last view of it); torch's pinned memory goes back in _hand_back."""
        if self.registered:
            from .gpu.host_register import unregister
            self.registered = False
            try:
                unregister(self.tensor.data_ptr())
            except RuntimeError as e:  # the memory still goes: a trim must not fail over it
                log.warning("gdsckpt: unlocking a pool arena: %s", e)


class Extent:
    """Where one chunk record's bytes sit: (arena, start, length) pieces, `nbytes` in all (a
    multiple of 4 KiB: the record's stored length rounded up, zero-padded)."""

    __slots__ = ("pieces", "nbytes")

    def __init__(self, pieces: list, nbytes: int):
        self.pieces, self.nbytes = pieces, nbytes

    def tensors(self, nbytes: int):
        """Host uint8 tensors covering the extent's first `nbytes` bytes, in order."""
        out, left = [], nbytes
        for arena, start, length in self.pieces:
            n = min(length, left)
            if n <= 0:
                break
            out.append(arena.tensor[start:start + n])
            left -= n
        return out

    def views(self) -> list:
        """memoryviews of the whole extent, in order: what os.pwritev takes."""
        return [arena.mv[start:start + length] for arena, start, length in self.pieces]

    def zero_tail(self, nbytes: int) -> None:
        """Zero the padding after the record's `nbytes`: the file format reads gaps as zero, and
        the pool's memory holds an older save's bytes."""
        pad = self.nbytes - nbytes
        if pad > 0:
            arena, start, length = self.pieces[-1]  # the padding (< 4 KiB) lies in the last piece
            arena.mv[start + length - pad:start + length] = _ZEROS[:pad]  # not a torch op: those let go of the GIL


class PinnedPool:
    """Arenas of host memory, handed out as 4 KiB-aligned extents. Thread-safe: the snapshot
    reserves, the background writer releases."""

    def __init__(self, pinned: bool, arena_bytes: int | None = None):
        self.pinned = pinned
        self.arena_bytes = arena_bytes or POOL_ARENA_BYTES
        self._arenas: list[_Arena] = []
        self._cond = threading.Condition()
        self.capacity = 0  # bytes allocated
        self.in_use = 0  # bytes in extents not yet released
        self.growing = 0  # bytes of the arena `grow` is allocating outside the lock
        self._trims = 0  # trims so far: one during a `grow` stops it (the memory is wanted back)

    def reserve(self, nbytes: int, limit: int, before_wait=None, grow_to: int = 0) -> tuple[Extent, float, float]:
        """An extent of align_up(nbytes) bytes: (extent, seconds waited for space, seconds
        spent allocating). Grows the pool up to `limit` bytes; beyond it waits for releases,
        calling `before_wait()` (outside the lock) first: it hands the caller's own finished
        extents to the writer, which must be able to free them.

        grow_to: grow to at least this many bytes (within `limit`) even where released room
        could be reused. A snapshot passes what it has reserved so far, so that the first save
        leaves a pool that holds a whole save at once, and later saves allocate nothing; reusing
        what the writer freed meanwhile would size the pool to a race and make every later save
        allocate a little more (page-locking costs ~0.25-0.5 s per GB: H100, 2026-11-24)."""
        need = align_up(nbytes)
        if need > limit:
            raise ValueError(f"a {need}-byte extent can never fit a pool limited to {limit} bytes")
        waited = allocated = 0.0
        flushed = False
        with self._cond:
            target = min(grow_to, limit)
            while self.capacity + self.growing < target and self._room(limit):
                allocated += self._grow(min(self._arena_size(limit), self._room(limit)))
            while self.in_use + need > limit or self.capacity - self.in_use < need:
                room = self._room(limit)
                if self.in_use + need <= limit and room > 0:
                    allocated += self._grow(min(self._arena_size(limit), room))
                    continue
                if self.in_use + need <= limit and self.growing:
                    # the room comes with the arena `grow` is allocating: wait for it, allocate no other
                    t = time.perf_counter()
                    self._cond.wait(timeout=1.0)
                    allocated += time.perf_counter() - t
                    continue
                if before_wait is not None and not flushed:
                    flushed = True
                    self._cond.release()
                    try:
                        before_wait()
                    finally:
                        self._cond.acquire()
                    continue
                t = time.perf_counter()
                self._cond.wait(timeout=1.0)
                waited += time.perf_counter() - t
                flushed = False
            extent = Extent(self._take(need), need)
            self.in_use += need
        return extent, waited, allocated

    def release(self, extent: Extent) -> None:
        with self._cond:
            for arena, start, length in extent.pieces:
                _free_range(arena.free, start, start + length)
            self.in_use -= extent.nbytes
            extent.pieces = []
            self._cond.notify_all()

    def grow(self, limit: int, stop=None) -> tuple[int, float]:
        """Allocate arenas until `limit` bytes are allocated (ahead of need: gdsckpt.reserve), one
        at a time without holding the lock while one is allocated (it counts in `growing`
        meanwhile); (bytes allocated, seconds). Nothing where the pool already holds `limit`.
        Stops early where stop() says so (asked between arenas), or where a trim (release_pools,
        a save with a smaller bound) asks for the memory back meanwhile: the arena in progress
        then goes back too."""
        allocated, t0 = 0, time.perf_counter()
        with self._cond:
            trims = self._trims
        while stop is None or not stop():
            with self._cond:
                size = min(self._arena_size(limit), self._room(limit))
                if size <= 0 or self._trims != trims:
                    break
                self.growing += size
            arena = None
            try:
                arena = _Arena(size, self.pinned)
            finally:
                with self._cond:
                    self.growing -= size
                    kept = arena is not None and self._trims == trims
                    if kept:
                        self._arenas.append(arena)
                        self.capacity += arena.size
                        allocated += arena.size
                    self._cond.notify_all()
            if not kept:
                if arena is not None:
                    arena.unlock()
                del arena
                self._hand_back()
                break
        return allocated, time.perf_counter() - t0

    def trim(self, limit: int) -> int:
        """Free whole idle arenas until at most `limit` bytes are allocated; bytes freed. A `grow`
        in progress stops."""
        freed = 0
        with self._cond:
            self._trims += 1
            for arena in reversed(list(self._arenas)):
                if self.capacity <= limit:
                    break
                if arena.free == [[0, arena.size]]:
                    self._arenas.remove(arena)
                    arena.unlock()
                    self.capacity -= arena.size
                    freed += arena.size
        if freed:
            self._hand_back()
        return freed

    def _hand_back(self) -> None:
        """Freed arenas from torch's pinned allocator: hand the pages back, not just to its cache."""
        if self.pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    def _room(self, limit: int) -> int:
        """Bytes the pool may still grow by under `limit`: neither allocated nor being allocated."""
        return max(0, (limit - self.capacity - self.growing) // ALIGN * ALIGN)

    def _arena_size(self, limit: int) -> int:
        """arena_bytes, or for a small bound a sixteenth of it (a power of two, at least 1 MiB), so
        that a small state's pool does not hold a whole 64 MiB arena for a few MiB of records."""
        small = 1 << max(20, (max(limit // 16, 1)).bit_length() - 1)
        return min(self.arena_bytes, small)

    def _grow(self, size: int) -> float:
        """Allocate one arena of `size` bytes (holding the lock); the seconds it took."""
        t = time.perf_counter()
        arena = _Arena(size, self.pinned)
        self._arenas.append(arena)
        self.capacity += arena.size
        return time.perf_counter() - t

    def _take(self, need: int) -> list:
        pieces, left = [], need
        for arena in self._arenas:
            free = arena.free
            while free and left:  # first fit, in address order
                start, end = free[0]
                n = min(end - start, left)
                pieces.append((arena, start, n))
                if n == end - start:
                    del free[0]
                else:
                    free[0] = [start + n, end]
                left -= n
            if not left:
                return pieces
        raise AssertionError("pool accounting: free bytes counted but not found")


def _free_range(free: list, start: int, end: int) -> None:
    i = bisect.bisect_left(free, [start, start])
    if i > 0 and free[i - 1][1] == start:  # merge with the range before
        i -= 1
        free[i][1] = end
    else:
        free.insert(i, [start, end])
    if i + 1 < len(free) and free[i + 1][0] == free[i][1]:  # and the one after
        free[i][1] = free[i + 1][1]
        del free[i + 1]


# ---------------------------------------------------------------- one pool per device per process

_pools: dict[str, PinnedPool] = {}
_pools_lock = threading.Lock()


def pool_for(device: torch.device | None) -> PinnedPool:
    """The pool for chunks coming from `device` (None or a CPU device: the CPU backend's)."""
    gpu = device is not None and device.type == "cuda"
    key = f"cuda:{device.index}" if gpu else "cpu"
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = PinnedPool(pinned=gpu)
        return pool


def pools() -> dict[str, dict]:
    """{device: {"capacity_bytes", "in_use_bytes"}} for every pool of this process."""
    with _pools_lock:
        return {k: {"capacity_bytes": p.capacity, "in_use_bytes": p.in_use} for k, p in _pools.items()}


def release_pools() -> int:
    """Free every arena no save is using (memory held for reuse goes back); bytes freed."""
    with _pools_lock:
        return sum(p.trim(0) for p in _pools.values())
