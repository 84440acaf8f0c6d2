"""Plan: group tensors into one byte stream per dtype and cut each stream into fixed-size chunks.

A chunk is a contiguous range of its stream's bytes; it maps onto one or more
tensor segments. A chunk that lies inside one tensor needs no gather copy.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from gdsckpt.core.defaults import PLAN_CACHE


# NamedTuples, not frozen dataclasses: a save builds thousands of these, and a frozen
# dataclass costs several times more to construct.
class TensorEntry(NamedTuple):
    key: str
    dtype: str
    shape: tuple[int, ...]
    stream: int
    offset: int  # byte offset inside its stream
    nbytes: int


class Segment(NamedTuple):
    tensor: int  # index into Plan.tensors
    tensor_offset: int  # byte offset inside the tensor
    chunk_offset: int  # byte offset inside the chunk
    length: int


class Chunk(NamedTuple):
    index: int
    stream: int
    offset: int  # logical byte offset inside the stream
    length: int  # logical bytes
    segments: tuple[Segment, ...]


@dataclass
class Stream:
    dtype: str
    codec: dict  # {"name": "ans", "data_type": "<f4"} ...
    nbytes: int = 0
    tensors: list[int] = field(default_factory=list)


@dataclass
class Plan:
    tensors: list[TensorEntry]
    streams: list[Stream]
    chunks: list[Chunk]

    @property
    def logical_bytes(self) -> int:
        return sum(s.nbytes for s in self.streams)


def make_plan(specs, choose_codec, chunk_bytes: int) -> Plan:
    """`specs`: (key, dtype name, shape, nbytes) per tensor, in tree order.
    `choose_codec(dtype name) -> codec spec`."""
    streams: list[Stream] = []
    stream_of: dict[str, int] = {}
    tensors: list[TensorEntry] = []
    for key, dtype, shape, nbytes in specs:
        if dtype not in stream_of:
            stream_of[dtype] = len(streams)
            streams.append(Stream(dtype, choose_codec(dtype)))
        s = stream_of[dtype]
        tensors.append(TensorEntry(key, dtype, tuple(shape), s, streams[s].nbytes, nbytes))
        streams[s].tensors.append(len(tensors) - 1)
        streams[s].nbytes += nbytes
    chunks: list[Chunk] = []
    for s, stream in enumerate(streams):
        chunks.extend(_cut(s, stream, tensors, chunk_bytes, len(chunks)))
    return Plan(tensors, streams, chunks)


def _cut(s: int, stream: Stream, tensors: list[TensorEntry], size: int, first: int) -> list[Chunk]:
    members = [i for i in stream.tensors if tensors[i].nbytes]
    chunks, t = [], 0
    for start in range(0, stream.nbytes, size):
        length = min(size, stream.nbytes - start)
        segs, t = segments(tensors, members, t, start, length)
        chunks.append(Chunk(first + len(chunks), s, start, length, segs))
    return chunks


def segments(tensors, members, t: int, start: int, length: int) -> tuple[tuple[Segment, ...], int]:
    """Tensor segments of the stream range [start, start+length); `members` are the stream's
    non-empty tensors in order and `t` the first that may overlap. Returns (segments, next t)."""
    end, segs = start + length, []
    while t < len(members):
        e = tensors[members[t]]
        lo, hi = max(start, e.offset), min(end, e.offset + e.nbytes)
        if lo < hi:
            segs.append(Segment(members[t], lo - e.offset, lo - start, hi - lo))
        if e.offset + e.nbytes <= end:
            t += 1
        else:
            break
    return tuple(segs), t


class Plans:
    """make_plan by layout, the newest `size` layouts kept: a training loop saves one layout again
    and again, and planning its thousand tensors is milliseconds of Python on the thread an
    overlapped snapshot shares with training. A layout is the specs, the chunk size and the codec
    each dtype is planned with. Each call gets its own streams (the codec choice sets their
    specs); the tensors and chunks lists are the kept plan's, never changed after planning (the
    GPU's gather tables are kept by them)."""

    def __init__(self, size: int = PLAN_CACHE):
        self._size = size
        self._kept: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, specs, choose_codec, chunk_bytes: int) -> Plan:
        specs = tuple(specs)
        codec_of = {dtype: choose_codec(dtype) for dtype in dict.fromkeys(s[1] for s in specs)}
        key = (specs, chunk_bytes, json.dumps(codec_of, sort_keys=True))
        with self._lock:
            plan = self._kept.get(key)
            if plan is not None:
                self._kept.move_to_end(key)
        if plan is None:
            plan = make_plan(specs, codec_of.__getitem__, chunk_bytes)
            with self._lock:
                self._kept[key] = plan
                while len(self._kept) > self._size:
                    self._kept.popitem(last=False)
        return Plan(plan.tensors, [replace(st, codec=dict(st.codec)) for st in plan.streams], plan.chunks)


PLANS = Plans()  # the process's: every save shares it
