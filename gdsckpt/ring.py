"""The ring: K slots in flight, so that compressing chunk i+1 overlaps writing chunk i
(and, on restore, reading chunk i+1 overlaps verifying and decoding chunk i).

Backend-neutral: byte views are 1-D uint8 torch tensors, and the backend
(gdsckpt/backend.py for the CPU, gdsckpt/gpu/backend.py for the GPU) supplies
buffers, copies, codecs, checksums and files whose futures have `.get()`.
A slot is reused only after the I/O that used it has completed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

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
    staging: object  # logical bytes: gather target on save, decode target on restore
    stored: object  # stored bytes: codec output on save, read buffer on restore
    pending: object = None  # the I/O future using this slot
    started: float = 0.0


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


def write_chunks(plan: Plan, views, backend, file, depth: int, timings: Timings) -> list[ChunkRecord]:
    """Compress and write every chunk of `plan`; `views[i]` is tensor i's bytes."""
    if not plan.chunks:
        return []
    max_len = max(c.length for c in plan.chunks)
    max_stored = max(backend.max_stored(s.codec, max_len) for s in plan.streams)
    slots = [_Slot(backend.empty(max_len), backend.empty(max_stored)) for _ in range(depth)]
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
            src = _gather(chunk, views, slot, backend)
            t = timings.add("gather", t)
            spec = plan.streams[chunk.stream].codec
            # The codec writes into slot.stored, or, when it must repack its output, into slot.staging.
            stored, frames, payload = backend.encode(spec, src, slot.stored, slot.staging)
            t = timings.add("compress", t)
            raw = stored < 0
            if raw:  # would not shrink: store the logical bytes as they are
                payload, stored, frames = src, chunk.length, None
            payload = payload[:stored]
            ck = backend.checksum(payload)
            t = timings.add("checksum", t)
            slot.pending = file.pwrite(payload, stored, offset)
            timings.add("submit", t)
            records.append(ChunkRecord(offset, stored, raw, ck, frames))
            offset = align_up(offset + stored)
        t = time.perf_counter()
        _drain(slots, timings)
        timings.add("wait_io", t)
    finally:
        _drain(slots, ok=False)
    return records


def _gather(chunk: Chunk, views, slot: _Slot, backend):
    if len(chunk.segments) == 1:
        s = chunk.segments[0]
        view = views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
        if backend.direct(view):
            return view
    dst = slot.staging[:chunk.length]
    backend.gather(dst, [(s.chunk_offset, views[s.tensor], s.tensor_offset, s.length) for s in chunk.segments])
    return dst


def read_chunks(index, chunk_ids, views, backend, file, depth: int, timings: Timings, path) -> None:
    """Read, verify and decode the chunks `chunk_ids` into the tensors' byte views `views`
    (views[i] may be None for a tensor nobody asked for)."""
    plan, records = index.plan, index.records
    if not chunk_ids:
        return
    max_len = max(plan.chunks[i].length for i in chunk_ids)
    max_stored = max(records[i].stored for i in chunk_ids)
    slots = [_Slot(backend.empty(max_len), backend.empty(max_stored)) for _ in range(min(depth, len(chunk_ids)))]

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
            out = _target(chunk, views, slot, backend)
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
            if out.data_ptr() == slot.staging.data_ptr():
                for s in chunk.segments:
                    if views[s.tensor] is not None:
                        backend.copy(views[s.tensor][s.tensor_offset:s.tensor_offset + s.length],
                                     out[s.chunk_offset:s.chunk_offset + s.length])
            backend.synchronize()  # the slot's buffers are free only once the decode has run
            t = timings.add("scatter", t)
            timings.latencies.append(time.perf_counter() - slot.started)
            if j + len(slots) < len(chunk_ids):
                submit(slot, chunk_ids[j + len(slots)])
    finally:
        _drain(slots, ok=False)


def _target(chunk: Chunk, views, slot: _Slot, backend):
    """Decode straight into the destination tensor when the chunk lies inside one."""
    if len(chunk.segments) == 1:
        s = chunk.segments[0]
        if views[s.tensor] is not None:
            view = views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            if backend.direct(view):
                return view
    return slot.staging[:chunk.length]
