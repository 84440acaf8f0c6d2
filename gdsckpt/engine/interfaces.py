"""The engine's interfaces: what the ring needs from a device (`Backend`) and from where chunk
records go or come from (`ChunkFile`, and the two things a ChunkFile may also be: `MappedChunkFile`,
`ReadsAhead`). Implemented by gdsckpt/engine/cpu_backend.py, gdsckpt/engine/gpu/backend.py, the
memory tier's slots, the pinned pool and the bench's storage-removed sinks.

The call order of one save through the ring (engine/ring.py's write_chunks):

    with backend:                                  # __enter__: streams, buffers
        backend.begin()                            # after the caller's pending work on the tensors
        file = backend.open(path, "w")             # or a ChunkFile the caller made (a pool, a slot)
        gather = backend.gatherer(plan, views)
        sums = backend.checksums(algorithm, count)
        for each chunk, K in flight:               # a slot is reused only after its pwrite's get()
            logical, shuffled = gather(chunk, staging, spec)
            n, frames = backend.encode(spec, logical, slot, scratch, shuffled)
            sums.add(slot[:n])
            future = file.pwrite(slot, n, offset)  # reads slot after the work queued so far
        every future.get(); backend.finish()       # then sums.values() into the index
        file.close()

A read runs the same ring the other way: file.pread into a slot (announced first to a
ReadsAhead file), backend.checksum of the stored bytes, then backend.decode into the destination
(directly where backend.direct(view)) or into staging and backend.scatter; backend.finish().
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from gdsckpt.format.plan import Chunk, Plan

Bytes = torch.Tensor  # a 1-D uint8 tensor: host memory on the CPU backend, device memory on the GPU's


class IOFuture(Protocol):
    def get(self) -> int:
        """Wait for the I/O; the bytes it moved. May be called more than once."""


class ChunkFile(Protocol):
    """Where chunk records go (or come from): a file, or a bench sink with storage removed.
    `fd` is the host file descriptor for the small writes (header, index, footer) and fsync,
    None where there is no file. pwrite reads `buf` after the work its backend has queued so far
    (the ring does not wait for it): a copy ordered on the backend's stream, or a wait first."""

    fd: int | None

    def pwrite(self, buf: Bytes, nbytes: int, offset: int) -> IOFuture: ...

    def pread(self, buf: Bytes, nbytes: int, offset: int) -> IOFuture: ...

    def close(self) -> None: ...


# (chunk, staging, the chunk's codec spec) -> (bytes, shuffled): what the spec's coder reads. The
# chunk's logical bytes (a view of its tensor, or staging filled), or, with shuffled True, their
# byte planes of the spec's "shuffle" width in staging: the gather and the shuffle in one pass.
Gather = Callable[[Chunk, Bytes, dict], tuple[Bytes, bool]]


class Checksums(Protocol):
    """A save's chunk checksums, queued in the pipeline's order and read back together: on the
    GPU, one wait for the whole save instead of one per chunk."""

    def add(self, buf: Bytes) -> None: ...

    def values(self) -> list[int]:
        """Every added buffer's checksum, in the order added."""


class Backend(Protocol):
    """What the ring needs from a device: buffers, the gather, copies, codecs, checksums, files."""

    name: str  # "cpu" or "gpu"
    io_path: str  # the path bytes really take: "cpu", "compat" or "gds"
    nvcomp_version: str | None

    def __enter__(self) -> "Backend": ...

    def __exit__(self, *exc) -> bool: ...

    def begin(self) -> None:
        """Order the pipeline after the caller's pending work on the tensors."""

    def finish(self) -> None:
        """Wait for the pipeline's device work."""

    def synchronize(self) -> None: ...

    def memory(self) -> dict: ...

    def can_decode(self, spec: dict) -> bool: ...

    def empty(self, nbytes: int, *, once: bool = False) -> Bytes:
        """nbytes of the backend's memory. once=True: held through one call only (read_verified's
        buffer of every stored byte), and given back when freed rather than cached for later
        calls (the GPU's: outside torch's cache, gpu/device_block.py)."""

    def direct(self, view: Bytes) -> bool:
        """True if a decoder may write into `view` (a destination tensor's bytes) directly."""

    def copy(self, dst: Bytes, src: Bytes) -> None: ...

    def scatter(self, copies: list[tuple[Bytes, Bytes]]) -> None:
        """copy(dst, src) for each pair: a decoded chunk's segments into their tensors, at once."""

    def gatherer(self, plan: Plan, views: "ByteViews") -> Gather: ...

    def max_stored(self, spec: dict, nbytes: int) -> int: ...

    def encode(self, spec: dict, src: Bytes, out: Bytes, scratch: Bytes, shuffled: bool = False) -> tuple[int, list | None]:
        """(stored length, zstd frame lengths) with the stored bytes in `out`; (-1, None) if it would
        not shrink, `src` then holding the logical bytes. shuffled: `src` is the gather's byte planes."""

    def decode(self, spec: dict, stored: Bytes, out: Bytes, frames: list | None) -> None: ...

    def checksum(self, buf: Bytes, algorithm: str) -> int:
        """`buf`'s checksum by one of checksum.ALGORITHMS (the file's version decides which)."""

    def checksums(self, algorithm: str, count: int) -> Checksums:
        """Up to `count` checksums by `algorithm`, read back once (the save ring's)."""

    def open(self, path: Path, mode: str) -> ChunkFile: ...


@runtime_checkable
class MappedChunkFile(ChunkFile, Protocol):
    """A ChunkFile whose records already lie in memory its backend reads (a memory copy's
    mapping, for the CPU backend): they are checked and decoded where they lie, never copied."""

    def view(self, nbytes: int, offset: int) -> Bytes:
        """The `nbytes` at `offset`, in place (fewer past the end of what is mapped)."""


@runtime_checkable
class ReadsAhead(ChunkFile, Protocol):
    """A ChunkFile that reads records ahead once told which ones a read will ask for
    (gdsckpt/engine/read_ahead.py). Its preads of those records are waited for in the order asked.
    `io_path` is the path its reads take, and `stages` where its preads' time went (inside the
    ring's "read_wait"), for the read's Stats."""

    io_path: str
    stages: dict[str, float]

    def will_read(self, ranges: list[tuple[int, int]]) -> None:
        """(file offset, stored bytes) of the records the next preads ask for, in that order."""
