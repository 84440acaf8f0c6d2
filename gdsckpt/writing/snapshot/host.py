"""The compressed snapshot behind save_async (and GdsckptWriter's DCP staging): save_flat's ring
(gather, compress, checksum) runs on the live tensors and hands each chunk record to
`PoolFile.pwrite`, which copies the stored bytes into the host pool; the background writer
(gdsckpt/writing/background_writer.py) then writes them to the file. Extra GPU memory: the ring's,
nothing more.

On the GPU the copies are device-to-host on one dedicated copy stream per GPU, ordered after
the ring's stream by an event per chunk, so that copying chunk i overlaps compressing chunk
i+1; the ring reuses a slot only once the copy out of it has finished (the future's get()
waits on its event). On the CPU backend the copy is a memcpy. A chunk goes to the writer as
soon as its copy is known complete, in file order.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from gdsckpt.format import file as fmt
from gdsckpt.writing.background_writer import Job, submit
from gdsckpt.core.defaults import CHUNK_BYTES
from gdsckpt.engine.device_copy import side_stream
from gdsckpt.engine.pinned_pool import align_up, pool_for
from gdsckpt.engine.ring import Completion
from gdsckpt.writing.save import Destination, Snapshot

UNBOUNDED = 1 << 62


def copy_to_host(buf: torch.Tensor, dsts: list) -> torch.cuda.Event | None:
    """Queue the copy of a chunk record's bytes (`buf`, from its start) into the host tensors
    `dsts`, in order: device-to-host on the GPU's copy stream, ordered after the ring's stream
    (returns the copy's event), or a memcpy, complete on return (returns None)."""
    event = None
    if buf.is_cuda:
        stream = side_stream("copy", buf.device)
        stream.wait_stream(torch.cuda.current_stream(buf.device))  # the ring's stream: the record is ready
        with torch.cuda.stream(stream):
            pos = 0
            for dst in dsts:
                n = dst.numel()
                dst.copy_(buf[pos:pos + n], non_blocking=True)
                pos += n
            event = torch.cuda.Event()
            event.record(stream)
    else:
        pos = 0
        for dst in dsts:
            n = dst.numel()
            dst.copy_(buf[pos:pos + n])
            pos += n
    return event


@dataclass
class HostFigures:
    """What a compressed snapshot's host memory did, for save_async's AsyncStats."""

    io_path: str  # how the bytes left host memory: "pool-direct", "pool-buffered", or "memory" (kept there)
    file_bytes: int
    host_bytes: int  # host memory the snapshot's store holds
    pinned_bytes: int  # of which page-locked
    limit_bytes: int
    peak_bytes: int  # in use at most during the snapshot
    waits: int  # times the snapshot waited for room
    wait_s: float
    alloc_s: float  # allocating (and page-locking) host memory


class SnapshotDestination(Destination, Protocol):
    """A save.Destination that holds the compressed snapshot in host memory, as save_async takes
    it: `done` completes (with a background_writer.WriteReport) once the bytes are where they
    go, `figures(report)` says what the host memory did."""

    done: Future

    def figures(self, report) -> HostFigures: ...


class SnapshotTarget(Protocol):
    """Where save_async(memory=) puts a compressed snapshot instead of the pool: the memory tier's
    (gdsckpt/manager/memory/snapshot.py). `target` is the checkpoint's path (it names the snapshot)."""

    def destination(self, target, options) -> SnapshotDestination: ...


class DeferredLayout(fmt.FileWriter):
    """format.FileWriter for a file written later: it places records as FileWriter does and
    writes nothing; the background writer writes the header (format.header_bytes) and `sealed`,
    the index and footer (offset, bytes), once the ring has placed every record."""

    def __init__(self, meta: dict, skeleton: dict, devices: list[str], plan):
        super().__init__(None, meta, skeleton, devices, plan)
        self.sealed: tuple[int, bytes] | None = None

    def finish(self, records) -> None:
        self.sealed = self.tail(records)


class PoolFile:
    """interfaces.ChunkFile into the host pool. pwrite returns once the copy is queued; its future's
    get() returns once the bytes are in the pool (the ring's slot is free again)."""

    fd = None  # nothing is written to a file here

    def __init__(self, pool, job: Job, limit: int):
        self.pool, self.job, self.limit = pool, job, limit
        self._pending: deque = deque()  # [event or None, extent, offset] in pwrite order
        self.waits = 0  # reservations that waited for the writer to free room
        self.wait_s = 0.0
        self.alloc_s = 0.0  # growing the pool (the first saves)
        self.peak = pool.in_use
        self._want = pool.in_use  # what the pool should hold for this snapshot not to wait: see reserve's grow_to

    def pwrite(self, buf: torch.Tensor, nbytes: int, offset: int) -> Completion:
        self._handoff(block=False)
        self._want += align_up(nbytes)
        extent, waited, allocated = self.pool.reserve(nbytes, self.limit, self.flush, grow_to=self._want)
        try:
            self.waits += waited > 0
            self.wait_s += waited
            self.alloc_s += allocated
            self.peak = max(self.peak, self.pool.in_use)
            extent.zero_tail(nbytes)
            event = self._copy(buf, extent, nbytes)
            entry = [event, extent, offset]
            self._pending.append(entry)
        except BaseException:  # KeyboardInterrupt included: the room is not the writer's to free
            self._give_back(extent, buf)
            raise
        if event is None:
            self._handoff(block=False)
        return Completion(lambda: self._wait(entry, nbytes))

    @staticmethod
    def _copy(buf: torch.Tensor, extent, nbytes: int):
        return copy_to_host(buf, extent.tensors(nbytes))

    def _give_back(self, extent, buf: torch.Tensor) -> None:
        """Release an extent whose copy failed part-way, once no copy into it can still land."""
        try:
            if buf.is_cuda:
                side_stream("copy", buf.device).synchronize()
        except Exception:  # noqa: BLE001 - a CUDA error: no copy lands any more
            pass
        finally:
            self.pool.release(extent)

    def _wait(self, entry, nbytes: int) -> int:
        if entry[0] is not None:
            entry[0].synchronize()
        self._handoff(block=False)  # this one and, copied on the same stream before it, all earlier
        return nbytes

    def _handoff(self, block: bool) -> None:
        """Give the writer every record whose copy has finished, in pwrite order."""
        while self._pending:
            event, extent, offset = self._pending[0]
            if event is not None:
                if block:
                    event.synchronize()
                elif not event.query():
                    return
            self._pending.popleft()
            self.job.put(extent, offset)

    def flush(self) -> None:
        """Wait for every queued copy and hand its record to the writer."""
        self._handoff(block=True)

    def discard(self) -> None:
        """Release the room of every record not handed to the writer (a flush that failed on a
        failed snapshot), each once its copy has ended, as far as CUDA can still tell."""
        while self._pending:
            event, extent, _ = self._pending.popleft()
            try:
                if event is not None:
                    event.synchronize()
            except Exception:  # noqa: BLE001 - a CUDA error: no copy lands any more
                pass
            finally:
                self.pool.release(extent)

    def pread(self, buf, nbytes: int, offset: int):
        raise NotImplementedError("the pool is written, never read back")

    def close(self) -> None:
        pass


class PoolDestination:
    """save.save_flat's destination for a compressed snapshot (save.NewFile is the file one).

    path: where the background writer commits the file; given here, the file is written while
    the snapshot runs (streaming, and back-pressure can make progress). None: the records stay
    in the pool until `submit(path)` (DCP staging, whose file name is known only later).
    limit: the most the pool may hold while this snapshot reserves (at least one chunk): bytes,
    None (no bound: DCP staging, which must hold its whole save), or a function of the plan,
    called once the plan is known (save_async's default bound).

    Every record's room in the pool goes back on any failure, KeyboardInterrupt included: the
    writer releases what it was handed (the job is aborted), the rest is released here."""

    def __init__(self, path, limit, chunk_bytes: int | None = None):
        self.path = path
        self.label = str(path) if path is not None else "<staged>"
        self._limit, self._chunk_bytes = limit, chunk_bytes
        self.pool = self.job = self.file = self.deferred = None  # deferred: the file's DeferredLayout
        self.limit = 0

    def open(self, be) -> PoolFile:
        self.pool = pool_for(getattr(be, "device", None) if be.name == "gpu" else None)
        one_chunk = align_up(self._chunk_bytes or CHUNK_BYTES[be.name])
        self._one_chunk = one_chunk
        self.limit = UNBOUNDED if self._limit is None or callable(self._limit) else max(self._limit, one_chunk)
        if self.pool.capacity > self.limit:
            self.pool.trim(self.limit)  # a smaller bound than an earlier save's: give idle memory back
        self.job = Job(self.pool, self.label)
        self.file = PoolFile(self.pool, self.job, self.limit)
        if self.path is not None:
            try:
                submit(self.job, self.path)
            except BaseException as e:  # a job queued but never sealed would stop the writer for good
                self.job.abort(e)
                raise
        return self.file

    def layout(self, fd, meta: dict, skeleton: dict, devices: list[str], plan) -> DeferredLayout:
        if callable(self._limit):  # before the first chunk: the ring reserves only after the layout exists
            self.file.limit = self.limit = max(self._limit(plan), self._one_chunk)
            if self.pool.capacity > self.limit:
                self.pool.trim(self.limit)
        meta = dict(meta, writer=dict(meta.get("writer") or {}, io_path="pool"))
        self.deferred = DeferredLayout(meta, skeleton, devices, plan)
        return self.deferred

    def commit(self, file: PoolFile) -> None:
        file.flush()
        self.job.seal(*self.deferred.sealed)

    def abort(self, file: PoolFile, error: BaseException) -> None:
        try:
            file.flush()  # no copy may still land in memory the pool hands out again
        finally:
            try:
                file.discard()  # what a failed flush did not hand to the writer
            finally:
                self.job.abort(error)
                if self.path is None:
                    self.job.drop()

    @property
    def done(self) -> Future:
        return self.job.done

    def figures(self, report) -> HostFigures:
        return HostFigures("pool-direct" if report.direct_io else "pool-buffered", self.deferred.file_bytes,
                           self.pool.capacity, self.pool.capacity if self.pool.pinned else 0, self.limit,
                           self.file.peak, self.file.waits, self.file.wait_s, self.file.alloc_s)

    def submit(self, path) -> Job:
        """Staged records (path=None): write them to `path` now, after earlier jobs."""
        self.path, self.label = path, str(path)
        self.job.label = self.label
        submit(self.job, path)
        return self.job


class HostSnapshot:
    """snapshot="host", the default (a snapshot_modes.SnapshotMode): the ring compresses the live
    tensors into the host pool in the call; a first save, whose pool is not there yet, copies
    the state on its GPU and compresses the copy off the call instead (device_copy.copy_first).
    Given an optimizer where it is only the default, a save overlaps ("overlap")."""

    name = Snapshot.HOST
    used_by = ("save_async", "dcp")
    optimizer = "refused"
    with_optimizer = Snapshot.OVERLAP
    uses_pool = True

    def save(self, call):
        return call.copy_first() or call.take()

    def stage(self, call):
        staged = call.copy_first()
        return call.take() if staged is None else staged
