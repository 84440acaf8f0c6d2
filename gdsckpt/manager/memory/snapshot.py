"""save_async's compressed snapshot into the memory tier (gdsckpt/manager/memory/tier.py), and the local
write of a memory copy.

`MemoryTarget(tier, step)` is what the Checkpointer passes as save_async(memory=): the ring
(gather, compress, checksum) runs on the live tensors as for the pinned pool, and each chunk
record is copied (device-to-host on the copy stream, or a memcpy) straight to its offset in a
slot of the tier, the header first and the index and footer last, so that the slot holds the
checkpoint file's bytes. The memory copy IS the snapshot: there is no pool copy and no second
copy. The copy counts once its commit record is written, at the end of the snapshot;
save_async's future completes then.

`local_write(tier, step, path)` writes a committed copy to the local directory through the
background writer (gdsckpt/writing/background_writer.py: O_DIRECT, fsync, atomic rename), as save_async
writes its pool's bytes: the file is byte for byte the slot's image.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import torch

from gdsckpt.format import file as fmt
from gdsckpt.writing.background_writer import Job, WriteReport, submit
from gdsckpt.writing.snapshot.host import DeferredLayout, HostFigures, copy_to_host
from .slot import Slot
from .tier import MemoryTier
from gdsckpt.engine.pinned_pool import align_up
from gdsckpt.engine.interfaces import Backend
from gdsckpt.engine.ring import Completion

# Room for the index and footer beyond the records, per tensor and chunk: an index that needs
# more makes the slot's file grow (through its descriptor, not the mapping).
INDEX_ALLOWANCE = 64 << 10
INDEX_PER_ENTRY = 256
# Bytes of the slot one pwritev of a local write takes: O_DIRECT-aligned pieces.
WRITE_PIECE = 64 << 20


def slot_bytes(plan) -> int:
    """The slot a snapshot of `plan` takes: the header, every chunk's record (stored raw at worst,
    rounded up to 4 KiB) and the index's allowance."""
    records = fmt.HEADER_SIZE + sum(align_up(c.length) for c in plan.chunks)
    allowance = INDEX_ALLOWANCE + INDEX_PER_ENTRY * (len(plan.tensors) + len(plan.chunks))
    return align_up(records + allowance)


class MemoryTarget:
    """save_async(memory=): `step`'s snapshot into `tier` (host_snapshot.SnapshotTarget)."""

    def __init__(self, tier: MemoryTier, step: int):
        self.tier, self.step = tier, step

    def destination(self, target, options) -> MemoryDestination:
        return MemoryDestination(self.tier, self.step, str(target))


class SlotFile:
    """interfaces.ChunkFile into a slot: pwrite queues the copy of a record to its offset (zeroing the
    padding to the next 4 KiB, which the slot may hold from an earlier step); its future's get()
    returns once the bytes are in the slot (the ring's buffer is free again)."""

    fd = None  # nothing is written to a file here

    def __init__(self):
        self.slot: Slot | None = None  # given by the destination's layout, before the first record
        self.alloc_s = 0.0
        self._last = None  # the last copy's event: copies on the copy stream complete in order

    def pwrite(self, buf: torch.Tensor, nbytes: int, offset: int) -> Completion:
        dsts, spent = self.slot.host(offset, offset + nbytes, pin=buf.is_cuda)
        self.alloc_s += spent
        self.slot.zero(offset + nbytes, align_up(offset + nbytes))
        event = copy_to_host(buf, dsts)
        if event is None:
            return Completion(lambda: nbytes)
        self._last = event

        def wait() -> int:
            event.synchronize()
            return nbytes
        return Completion(wait)

    def flush(self) -> None:
        """Wait for every queued copy."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None

    def pread(self, buf, nbytes: int, offset: int):
        raise NotImplementedError("the slot is written here; a restore reads it through memory_source")

    def close(self) -> None:
        pass


class MemoryDestination:
    """save.Destination (host_snapshot.SnapshotDestination) of one step's snapshot into the
    memory tier: the slot is reserved once the plan is known (the records' size bound), which
    may drop older copies or wait for a local write that reads one; the copy is committed in
    `commit`. On any failure the slot goes back to the tier, holding nothing that counts."""

    def __init__(self, tier: MemoryTier, step: int, label: str):
        self.tier, self.step, self.label = tier, step, label
        self.done: Future = Future()
        self.slot: Slot | None = None
        self.file: SlotFile | None = None
        self.deferred: DeferredLayout | None = None
        self.wait_s = self.reserve_s = 0.0
        self._committed = False

    def open(self, be: Backend) -> SlotFile:
        self.file = SlotFile()
        return self.file

    def layout(self, fd, meta: dict, skeleton: dict, devices: list[str], plan) -> DeferredLayout:
        t = time.perf_counter()
        self.slot, self.wait_s = self.tier.reserve(self.step, slot_bytes(plan))
        self.reserve_s = time.perf_counter() - t - self.wait_s
        self.file.slot = self.slot
        self.slot.write(fmt.header_bytes(), 0)
        # the file this becomes is written from the slot as save_async writes from its pool: alike
        meta = dict(meta, writer=dict(meta.get("writer") or {}, io_path="pool"))
        self.deferred = DeferredLayout(meta, skeleton, devices, plan)
        return self.deferred

    def commit(self, file: SlotFile) -> None:
        file.flush()
        offset, tail = self.deferred.sealed
        self.slot.write(tail, offset)
        self.tier.commit(self.slot, self.step, self.deferred.file_bytes)
        self._committed = True
        self.done.set_result(WriteReport())

    def abort(self, file: SlotFile, error: BaseException) -> None:
        try:
            if file is not None:
                file.flush()  # no copy may still land in a slot the tier hands out again
        except Exception:  # noqa: BLE001 - a CUDA error: no copy lands any more
            pass
        finally:
            if self.slot is not None and not self._committed:
                self.tier.abandon(self.slot)
            if not self.done.done():
                self.done.set_exception(error)

    def figures(self, report) -> HostFigures:
        st = self.tier.status()
        return HostFigures("memory", self.deferred.file_bytes, st["held_bytes"], st["pinned_bytes"], st["cap_bytes"],
                           st["held_bytes"], int(self.wait_s > 0), self.wait_s, self.reserve_s + self.file.alloc_s)


# ---------------------------------------------------------------- a copy to the local directory


class _Held:
    """The background writer releases each extent it wrote into its job's pool: a slot's bytes
    stay where they are (the copy is the tier's)."""

    @staticmethod
    def release(extent) -> None:
        pass


class _Range:
    """Bytes [start, end) of a slot as the background writer's extent (views(), nbytes)."""

    __slots__ = ("slot", "start", "end", "nbytes")

    def __init__(self, slot: Slot, start: int, end: int):
        self.slot, self.start, self.end, self.nbytes = slot, start, end, end - start

    def views(self) -> list:
        return self.slot.views(self.start, self.end)


def local_write(tier: MemoryTier, step: int, path: Path) -> Future:
    """Write `step`'s committed copy to `path` (fsync'd, renamed into place, directory fsync'd) on
    the background writer, after the files queued before it; a Future of its WriteReport. The
    copy is held (not dropped) until the write has ended."""
    copy = tier.hold(step)
    try:
        slot, nbytes = copy.slot, copy.nbytes
        tail_offset = fmt.read_footer(slot.read, nbytes, str(path))[0]
        job = Job(_Held, str(path))
        for start in range(fmt.HEADER_SIZE, tail_offset, WRITE_PIECE):
            job.put(_Range(slot, start, min(tail_offset, start + WRITE_PIECE)), start)
        job.seal(tail_offset, slot.read(nbytes - tail_offset, tail_offset))
        submit(job, path)
    except BaseException:
        tier.release(step)
        raise
    job.done.add_done_callback(lambda _: tier.release(step))
    return job.done
