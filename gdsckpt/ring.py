"""The ring: K slots in flight, so that compressing chunk i+1 overlaps writing chunk i
(and, on restore, reading chunk i+1 overlaps verifying and decoding chunk i).

Backend-neutral: byte views are 1-D uint8 torch tensors, and the ring works only through the
interfaces below (`Backend`, `ChunkFile`, `IOFuture`), implemented by gdsckpt/cpu_backend.py,
gdsckpt/gpu/backend.py and the bench's storage-removed sinks. Where a chunk's record goes in the
file is the format's business (`format.FileWriter`): the ring asks it.
A slot holds one chunk's stored bytes and is reused only after the I/O that used it has
completed. The logical-bytes buffer (gather target on save, decode target on restore) is one
for the whole ring: its use ends, in stream order, before the next chunk's begins.
GPU memory: chunk + depth x stored bound (nvCOMP's worst case, ~1.16 x chunk for ANS).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from .errors import ChecksumError, CheckpointFormatError
from .format import ChunkRecord, FileWriter, Index
from .plan import Chunk, Plan

Bytes = torch.Tensor  # a 1-D uint8 tensor: host memory on the CPU backend, device memory on the GPU's


class IOFuture(Protocol):
    def get(self) -> int:
        """Wait for the I/O; the bytes it moved. May be called more than once."""


class ChunkFile(Protocol):
    """Where chunk records go (or come from): a file, or a bench sink with storage removed.
    `fd` is the host file descriptor for the small writes (header, index, footer) and fsync,
    None where there is no file."""

    fd: int | None

    def pwrite(self, buf: Bytes, nbytes: int, offset: int) -> IOFuture: ...

    def pread(self, buf: Bytes, nbytes: int, offset: int) -> IOFuture: ...

    def close(self) -> None: ...


Gather = Callable[[Chunk, Bytes], Bytes]


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

    def empty(self, nbytes: int) -> Bytes: ...

    def direct(self, view: Bytes) -> bool:
        """True if a decoder may write into `view` (a destination tensor's bytes) directly."""

    def copy(self, dst: Bytes, src: Bytes) -> None: ...

    def gatherer(self, plan: Plan, views: "ByteViews") -> Gather:
        """(chunk, staging) -> the chunk's logical bytes: a view of its tensor, or `staging` filled."""

    def max_stored(self, spec: dict, nbytes: int) -> int: ...

    def encode(self, spec: dict, src: Bytes, out: Bytes, scratch: Bytes) -> tuple[int, list | None]:
        """(stored length, zstd frame lengths) with the stored bytes in `out`; (-1, None) if it would not shrink."""

    def decode(self, spec: dict, stored: Bytes, out: Bytes, frames: list | None) -> None: ...

    def checksum(self, buf: Bytes, algorithm: str) -> int:
        """`buf`'s checksum by one of checksum.ALGORITHMS (the file's version decides which)."""

    def open(self, path: Path, mode: str) -> ChunkFile: ...


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
            src = gather(chunk, staging[:chunk.length])
            t = timings.add("gather", t)
            spec = plan.streams[chunk.stream].codec
            stored, frames = backend.encode(spec, src, slot.stored, staging)
            t = timings.add("compress", t)
            raw = stored < 0
            if raw:  # would not shrink: store the logical bytes as they are
                stored, frames = chunk.length, None
                if src.data_ptr() == staging.data_ptr():  # staging is the next chunk's: keep a copy
                    backend.copy(slot.stored[:stored], src)
                    src = slot.stored
            payload = src[:stored] if raw else slot.stored[:stored]
            ck = backend.checksum(payload, layout.checksum)
            t = timings.add("checksum", t)
            offset = layout.place(stored)
            slot.pending = file.pwrite(payload, stored, offset)
            timings.add("submit", t)
            records.append(ChunkRecord(offset, stored, raw, ck, frames))
        t = time.perf_counter()
        layout.finish(records)
        t = timings.add("index", t)
        _drain(slots, timings)
        timings.add("wait_io", t)
    finally:
        _drain(slots, ok=False)
    return records


def read_chunks(index: Index, chunk_ids: list[int], views, backend: Backend, file: ChunkFile, depth: int,
                timings: Timings, path, *, verify_only: bool = False) -> None:
    """Read, verify and decode the chunks `chunk_ids` into the tensors' byte views `views`
    (views[i] may be None for a tensor nobody asked for). verify_only: read and check each
    chunk's checksum with the backend (on the GPU, its kernel), decode and write nothing."""
    plan, records = index.plan, index.records
    if not chunk_ids:
        return
    max_len = max(plan.chunks[i].length for i in chunk_ids)
    max_stored = max(records[i].stored for i in chunk_ids)
    staging = backend.empty(max_len)
    slots = [_Slot(backend.empty(max_stored)) for _ in range(min(depth, len(chunk_ids)))]

    def submit(slot, i):
        slot.started = time.perf_counter()
        slot.pending = file.pread(slot.stored, records[i].stored, records[i].file_offset)

    try:
        for j, i in enumerate(chunk_ids[:len(slots)]):
            submit(slots[j], i)
        for j, i in enumerate(chunk_ids):
            slot, chunk, rec = slots[j % len(slots)], plan.chunks[i], records[i]
            key = plan.tensors[chunk.segments[0].tensor].key
            t = time.perf_counter()
            fut, slot.pending = slot.pending, None
            got = fut.get()
            t = timings.add("read_wait", t)
            stored = slot.stored[:rec.stored]
            verify_chunk(got, backend.checksum(stored, index.checksum) if got == rec.stored else 0, rec, path, key, i)
            t = timings.add("verify", t)
            if verify_only:
                backend.synchronize()  # the slot is free once its checksum has run
                if j + len(slots) < len(chunk_ids):
                    submit(slot, chunk_ids[j + len(slots)])
                continue
            out = _target(chunk, views, staging, backend)
            spec = plan.streams[chunk.stream].codec
            try:
                if rec.raw:
                    backend.copy(out, stored)
                else:
                    backend.decode(spec, stored, out, rec.frames)
            except CheckpointFormatError:
                raise
            except Exception as e:  # a decoder's own complaint about the bytes it was given
                raise CheckpointFormatError(f"chunk failed to decode ({type(e).__name__}: {e})",
                                            path=path, key=key, chunk=i) from e
            t = timings.add("decompress", t)
            if out.data_ptr() == staging.data_ptr():
                for s in chunk.segments:
                    if views[s.tensor] is not None:
                        backend.copy(views[s.tensor][s.tensor_offset:s.tensor_offset + s.length],
                                     out[s.chunk_offset:s.chunk_offset + s.length])
            backend.synchronize()  # staging and the slot are free only once the decode has run
            t = timings.add("scatter", t)
            timings.latencies.append(time.perf_counter() - slot.started)
            if j + len(slots) < len(chunk_ids):
                submit(slot, chunk_ids[j + len(slots)])
    finally:
        _drain(slots, ok=False)


def _target(chunk: Chunk, views, staging, backend):
    """Decode straight into the destination tensor when the chunk lies inside one."""
    if len(chunk.segments) == 1:
        s = chunk.segments[0]
        if views[s.tensor] is not None:
            view = views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            if backend.direct(view):
                return view
    return staging[:chunk.length]
