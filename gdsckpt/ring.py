"""The ring: K slots in flight, so that compressing chunk i+1 overlaps writing chunk i
(and, on restore, reading chunk i+1 overlaps verifying and decoding chunk i).

Backend-neutral: byte views are 1-D uint8 torch tensors, and the backend
(gdsckpt/backend.py for the CPU, gdsckpt/gpu/backend.py for the GPU) supplies
buffers, the gather, copies, codecs, checksums and files whose futures have `.get()`.
A slot holds one chunk's stored bytes and is reused only after the I/O that used it has
completed. The logical-bytes buffer (gather target on save, decode target on restore) is one
for the whole ring: its use ends, in stream order, before the next chunk's begins.
GPU memory: chunk + depth x stored bound (nvCOMP's worst case, ~1.16 x chunk for ANS).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .errors import ChecksumError, CheckpointFormatError
from .format import HEADER_SIZE, ChunkRecord, align_up
from .plan import Chunk, Plan


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


def write_chunks(plan: Plan, tensors, backend, file, depth: int, timings: Timings, tail=None) -> list[ChunkRecord]:
    """Compress and write every chunk of `plan`; `tensors[i]` is plan.tensors[i]'s tensor.
    tail(records), if given, runs once the last chunk is submitted, while its writes are in flight."""
    if not plan.chunks:
        if tail is not None:
            tail([])
        return []
    max_len = max(c.length for c in plan.chunks)
    max_stored = max(backend.max_stored(s.codec, max_len) for s in plan.streams)
    gather = backend.gatherer(plan, ByteViews(tensors))
    staging = backend.empty(max_len)
    slots = [_Slot(backend.empty(max_stored)) for _ in range(depth)]
    records: list[ChunkRecord] = []
    offset = HEADER_SIZE
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
            ck = backend.checksum(payload)
            t = timings.add("checksum", t)
            slot.pending = file.pwrite(payload, stored, offset)
            timings.add("submit", t)
            records.append(ChunkRecord(offset, stored, raw, ck, frames))
            offset = align_up(offset + stored)
        t = time.perf_counter()
        if tail is not None:
            tail(records)
            t = timings.add("tail", t)
        _drain(slots, timings)
        timings.add("wait_io", t)
    finally:
        _drain(slots, ok=False)
    return records


def read_chunks(index, chunk_ids, views, backend, file, depth: int, timings: Timings, path) -> None:
    """Read, verify and decode the chunks `chunk_ids` into the tensors' byte views `views`
    (views[i] may be None for a tensor nobody asked for)."""
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
            if got != rec.stored:
                raise CheckpointFormatError(f"short read: {got} of {rec.stored} bytes", path=path, key=key, chunk=i)
            stored = slot.stored[:rec.stored]
            if backend.checksum(stored) != rec.checksum:
                raise ChecksumError("stored bytes do not match their checksum: the chunk is corrupt",
                                    path=path, key=key, chunk=i)
            t = timings.add("verify", t)
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
