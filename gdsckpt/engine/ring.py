"""The ring: K slots in flight, so that compressing chunk i+1 overlaps writing chunk i
(and, on restore, reading chunk i+1 overlaps verifying and decoding chunk i).

Backend-neutral: byte views are 1-D uint8 torch tensors, and the ring works only through the
interfaces of gdsckpt/engine/interfaces.py (`Backend`, `ChunkFile`, `IOFuture`), implemented by gdsckpt/engine/cpu_backend.py,
gdsckpt/engine/gpu/backend.py and the bench's storage-removed sinks. Where a chunk's record goes in the
file is the format's business (`format.FileWriter`): the ring asks it.
A slot holds one chunk's stored bytes and is reused only after the I/O that used it has
completed. The logical-bytes buffer (gather target on save, decode target on restore) is one
for the whole ring: its use ends, in stream order, before the next chunk's begins.
GPU memory: chunk + depth x stored bound (nvCOMP's worst case, ~1.16 x chunk for ANS).

A read that must check every chunk before it writes a byte (load_into(atomic=True)) streams twice
through the ring (verify_only, then read_chunks) unless the backend holds all the stored bytes:
then read_verified reads each record once, all at once, and checks them, and decode_verified
decodes from there (a memory copy's mapping on the CPU needs no read at all: MappedChunkFile).
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gdsckpt.errors import ChecksumError, CheckpointFormatError
from gdsckpt.format.file import ChunkRecord, FileWriter, Index, align_up
from gdsckpt.format.plan import Chunk, Plan
from .interfaces import Backend, Bytes, ChunkFile, Checksums, IOFuture, MappedChunkFile, ReadsAhead


class ChecksumList:
    """Checksums computed as they are added (the CPU's, and any algorithm without a queued form)."""

    def __init__(self, checksum: Callable[[Bytes], int]):
        self._checksum, self._values = checksum, []

    def add(self, buf: Bytes) -> None:
        self._values.append(self._checksum(buf))

    def values(self) -> list[int]:
        return self._values


class Completion:
    """The one IOFuture type: `wait()` runs once, on the first get(); later gets return its result."""

    __slots__ = ("_wait", "_result")

    def __init__(self, wait: Callable[[], int]):
        self._wait, self._result = wait, None

    def get(self) -> int:
        if self._wait is not None:
            self._result, self._wait = self._wait(), None
        return self._result


def verify_chunk(got: int, actual_checksum: int, rec: ChunkRecord, path, key: str, chunk: int) -> None:
    """The one verify step, before any decoder sees a chunk (restore and `Checkpoint.verify`)."""
    if got != rec.stored:
        raise CheckpointFormatError(f"short read: {got} of {rec.stored} bytes (the chunk extends past the end "
                                    "of the file?)", path=path, key=key, chunk=chunk)
    if actual_checksum != rec.checksum:
        raise ChecksumError("stored bytes do not match their checksum: the chunk is corrupt",
                            path=path, key=key, chunk=chunk)


@dataclass
class Timings:
    """Seconds per stage and per-chunk completion latencies, as the ring observed them."""

    stages: dict = field(default_factory=lambda: defaultdict(float))
    latencies: list = field(default_factory=list)

    def add(self, stage: str, t0: float) -> float:
        now = time.perf_counter()
        self.stages[stage] += now - t0
        return now


@dataclass
class _Slot:
    stored: object  # stored bytes: codec output on save, read buffer on restore
    pending: object = None  # the I/O future using this slot
    started: float = 0.0


class ByteViews:
    """Tensor i's bytes as a 1-D uint8 view, made on first use: a save of thousands of tensors
    reaches most of them only through a pointer, and a view costs microseconds to make.
    Non-contiguous (or lazily conjugated / negated) tensors are copied, that tensor only."""

    def __init__(self, tensors):
        self.tensors = tensors
        self._views: dict[int, object] = {}

    def plain(self, i: int) -> bool:
        """True if tensor i's own memory holds its bytes in order (data_ptr() is usable)."""
        t = self.tensors[i]
        return t.is_contiguous() and not (t.is_conj() or t.is_neg())

    def __getitem__(self, i: int):
        v = self._views.get(i)
        if v is None:
            t = self.tensors[i].resolve_conj().resolve_neg()
            v = self._views[i] = t.contiguous().reshape(-1).view(torch.uint8)
        return v


def _drain(slots, timings: Timings | None = None, ok: bool = True) -> None:
    """Wait for every in-flight I/O; buffers must outlive the I/O that uses them.
    ok=False: on the error path, where the first error is already on its way up."""
    for slot in slots:
        if slot.pending is not None:
            fut, slot.pending = slot.pending, None
            try:
                fut.get()
                if timings is not None:
                    timings.latencies.append(time.perf_counter() - slot.started)
            except Exception:
                if ok:
                    raise


def write_chunks(plan: Plan, tensors, backend: Backend, file: ChunkFile, layout: FileWriter, depth: int,
                 timings: Timings) -> list[ChunkRecord]:
    """Compress and write every chunk of `plan`; `tensors[i]` is plan.tensors[i]'s tensor.
    `layout` places each record; it writes the index and footer once the last chunk is
    submitted, while the last writes are still in flight."""
    if not plan.chunks:
        layout.finish([])
        return []
    max_len = max(c.length for c in plan.chunks)
    max_stored = max(backend.max_stored(s.codec, max_len) for s in plan.streams)
    gather = backend.gatherer(plan, ByteViews(tensors))
    staging = backend.empty(max_len)
    slots = [_Slot(backend.empty(max_stored)) for _ in range(depth)]
    sums = backend.checksums(layout.checksum, len(plan.chunks))
    records: list[ChunkRecord] = []
    try:
        for chunk in plan.chunks:
            slot = slots[chunk.index % depth]
            t = time.perf_counter()
            if slot.pending is not None:
                fut, slot.pending = slot.pending, None
                fut.get()
                timings.latencies.append(time.perf_counter() - slot.started)
                t = timings.add("wait_io", t)
            slot.started = t
            spec = plan.streams[chunk.stream].codec
            src, shuffled = gather(chunk, staging[:chunk.length], spec)
            t = timings.add("gather", t)
            stored, frames = backend.encode(spec, src, slot.stored, staging, shuffled)
            t = timings.add("compress", t)
            raw = stored < 0
            if raw:  # would not shrink: store the logical bytes as they are
                stored, frames = chunk.length, None
                if src.data_ptr() == staging.data_ptr():  # staging is the next chunk's: keep a copy
                    backend.copy(slot.stored[:stored], src)
                    src = slot.stored
            payload = src[:stored] if raw else slot.stored[:stored]
            sums.add(payload)  # queued; read back with the others once the last chunk is queued
            t = timings.add("checksum", t)
            offset = layout.place(stored)
            slot.pending = file.pwrite(payload, stored, offset)
            timings.add("submit", t)
            records.append(ChunkRecord(offset, stored, raw, 0, frames))
        t = time.perf_counter()
        for rec, ck in zip(records, sums.values(), strict=True):
            rec.checksum = ck
        t = timings.add("checksum", t)
        layout.finish(records)
        t = timings.add("index", t)
        _drain(slots, timings)
        timings.add("wait_io", t)
    finally:
        _drain(slots, ok=False)
    return records


def _check_stored(index: Index, i: int, stored: Bytes, got: int, backend: Backend, path) -> None:
    """verify_chunk for chunk i read into `stored` (`got` bytes of it), with the backend's checksum."""
    rec, chunk = index.records[i], index.plan.chunks[i]
    key = index.plan.tensors[chunk.segments[0].tensor].key
    verify_chunk(got, backend.checksum(stored, index.checksum) if got == rec.stored else 0, rec, path, key, i)


def read_chunks(index: Index, chunk_ids: list[int], views, backend: Backend, file: ChunkFile, depth: int,
                timings: Timings, path, *, verify_only: bool = False, reached: list[int] | None = None) -> None:
    """Read, verify and decode the chunks `chunk_ids` into the tensors' byte views `views`
    (views[i] may be None for a tensor nobody asked for). verify_only: read and check each
    chunk's checksum with the backend (on the GPU, its kernel), decode and write nothing.
    `reached` gets each chunk's id as its bytes go to its tensors (its checksum passed): what a
    failed read had overwritten."""
    plan, records = index.plan, index.records
    if not chunk_ids:
        return
    max_len = max(plan.chunks[i].length for i in chunk_ids)
    max_stored = max(records[i].stored for i in chunk_ids)
    staging = backend.empty(max_len)
    slots = [_Slot(backend.empty(max_stored)) for _ in range(min(depth, len(chunk_ids)))]
    announce(file, index, chunk_ids)

    def submit(slot, i):
        slot.started = time.perf_counter()
        slot.pending = file.pread(slot.stored, records[i].stored, records[i].file_offset)

    try:
        for j, i in enumerate(chunk_ids[:len(slots)]):
            submit(slots[j], i)
        for j, i in enumerate(chunk_ids):
            slot = slots[j % len(slots)]
            t = time.perf_counter()
            fut, slot.pending = slot.pending, None
            got = fut.get()
            t = timings.add("read_wait", t)
            stored = slot.stored[:records[i].stored]
            _check_stored(index, i, stored, got, backend, path)
            t = timings.add("verify", t)
            if verify_only:
                backend.synchronize()  # the slot is free once its checksum has run
                if j + len(slots) < len(chunk_ids):
                    submit(slot, chunk_ids[j + len(slots)])
                continue
            if reached is not None:
                reached.append(i)
            t = _decode_chunk(index, i, stored, views, staging, backend, timings, path)
            backend.synchronize()  # staging and the slot are free only once the decode has run
            t = timings.add("scatter", t)
            timings.latencies.append(time.perf_counter() - slot.started)
            if j + len(slots) < len(chunk_ids):
                submit(slot, chunk_ids[j + len(slots)])
    finally:
        _drain(slots, ok=False)


def announce(file: ChunkFile, index: Index, chunk_ids: list[int]) -> None:
    """Tell a file that reads ahead which records follow, in the order they will be asked for."""
    if isinstance(file, ReadsAhead):
        file.will_read([(index.records[i].file_offset, index.records[i].stored) for i in chunk_ids])


def in_place(file: ChunkFile) -> bool:
    """True where `file`'s records need no read: read_verified views them, at no cost in memory."""
    return isinstance(file, MappedChunkFile)


def read_room(index: Index, chunk_ids: list[int]) -> int:
    """The backend memory read_verified takes for `chunk_ids` when `file` is not in place: every
    stored record, each at a 4 KiB boundary."""
    return sum(align_up(index.records[i].stored) for i in chunk_ids)


def read_verified(index: Index, chunk_ids: list[int], backend: Backend, file: ChunkFile, timings: Timings, path,
                  *, check: Callable[[int, Bytes], None] | None = None, workers: int = 1) -> list[Bytes]:
    """The first pass of a read that moves each stored byte once (decode_verified is the second):
    every chunk's stored bytes in the backend's memory, in place where `file` is a
    MappedChunkFile, else all read at once into one buffer (read_room bytes), and every checksum
    checked (and `check(chunk id, stored bytes)`, the reader's own checks), nothing decoded or
    written. The stored bytes of chunk_ids[j] are at [j]. `workers` threads check chunks side by
    side (the CPU's checksum lets go of the GIL); the error raised is the first damaged chunk's in
    chunk order. Stages: "atomic_read" (waiting for reads), "atomic_verify" (checking)."""
    records = index.records
    futures: list[IOFuture] = []
    if in_place(file):
        stored = [file.view(records[i].stored, records[i].file_offset) for i in chunk_ids]
    else:
        buf = backend.empty(read_room(index, chunk_ids), once=True)
        announce(file, index, chunk_ids)
        stored, at = [], 0
        for i in chunk_ids:
            rec = records[i]
            stored.append(buf[at:at + rec.stored])
            futures.append(file.pread(stored[-1], rec.stored, rec.file_offset))
            at += align_up(rec.stored)

    def check_one(j: int, got: int) -> None:
        i, data = chunk_ids[j], stored[j][:got]
        _check_stored(index, i, data, got, backend, path)
        if check is not None:
            check(i, data)

    done = False
    try:
        t = time.perf_counter()
        if workers > 1 and not futures and len(chunk_ids) > 1:
            pool = ThreadPoolExecutor(workers, thread_name_prefix="gdsckpt-verify")
            try:
                for _ in pool.map(lambda j: check_one(j, len(stored[j])), range(len(chunk_ids))):
                    pass
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            timings.add("atomic_verify", t)
        else:
            for j in range(len(chunk_ids)):
                got = futures[j].get() if futures else len(stored[j])
                t = timings.add("atomic_read", t)
                check_one(j, got)
                t = timings.add("atomic_verify", t)
        done = True
    finally:
        if not done:  # the buffer outlives every read into it
            for fut in futures:
                try:
                    fut.get()
                except Exception:
                    pass
    return stored


def decode_verified(index: Index, chunk_ids: list[int], stored: list[Bytes], views, backend: Backend,
                    timings: Timings, path, *, reached: list[int] | None = None) -> None:
    """The second pass: chunk_ids[j] decoded from stored[j] (read_verified's) into the tensors'
    byte views `views`, in chunk order; `reached` as for read_chunks. Nothing waits between
    chunks: no buffer is reused but the staging one, in the backend's stream order."""
    if not chunk_ids:
        return
    staging = backend.empty(max(index.plan.chunks[i].length for i in chunk_ids))
    for j, i in enumerate(chunk_ids):
        if reached is not None:
            reached.append(i)
        _decode_chunk(index, i, stored[j], views, staging, backend, timings, path)
    t = time.perf_counter()
    backend.synchronize()
    timings.add("decompress", t)


def _decode_chunk(index: Index, i: int, stored: Bytes, views, staging: Bytes, backend: Backend, timings: Timings,
                  path) -> float:
    """Chunk i's verified stored bytes decoded into its tensors' views: straight into its tensor
    where it lies inside one, else into `staging` and copied out. Stages "decompress" and
    "scatter"; returns the time it ended."""
    plan, rec = index.plan, index.records[i]
    chunk = plan.chunks[i]
    t = time.perf_counter()
    out = _target(chunk, views, staging, backend)
    try:
        if rec.raw:
            backend.copy(out, stored)
        else:
            backend.decode(plan.streams[chunk.stream].codec, stored, out, rec.frames)
    except CheckpointFormatError:
        raise
    except Exception as e:  # a decoder's own complaint about the bytes it was given
        raise CheckpointFormatError(f"chunk failed to decode ({type(e).__name__}: {e})", path=path,
                                    key=plan.tensors[chunk.segments[0].tensor].key, chunk=i) from e
    t = timings.add("decompress", t)
    if out.data_ptr() == staging.data_ptr():
        backend.scatter([(views[s.tensor][s.tensor_offset:s.tensor_offset + s.length],
                          out[s.chunk_offset:s.chunk_offset + s.length])
                         for s in chunk.segments if views[s.tensor] is not None])
    return timings.add("scatter", t)


def _target(chunk: Chunk, views, staging, backend):
    """Decode straight into the destination tensor when the chunk lies inside one."""
    if len(chunk.segments) == 1:
        s = chunk.segments[0]
        if views[s.tensor] is not None:
            view = views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            if backend.direct(view):
                return view
    return staging[:chunk.length]
