"""codec="auto" per stream: of the specs codecs.candidates offers a stream (on the GPU, typed ANS
and byte-plane ANS for float streams), the one that stores a sample of the stream's own bytes
smallest; typed ANS, the first, on a tie. Runs between planning and the ring (save.save_flat):

    choose_codecs(plan, candidates_of, Sampler(backend, plan, tensors))

The sample (`sample_ranges`): CODEC_SAMPLE_PIECES pieces spread evenly over the stream, gathered
from the save's tensors and compressed by the save's backend, each as a chunk of its own
(`Sampler`). A choice is kept per stream layout (`Choices`): later saves of a state of the same
keys and shapes sample nothing. The index records each stream's spec, so the choice is in the
file, and a reader needs nothing from here.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from typing import Callable

from gdsckpt.core.defaults import CODEC_CHOICE_CACHE, CODEC_SAMPLE_PIECE_BYTES, CODEC_SAMPLE_PIECES
from gdsckpt.format.plan import Chunk, Plan, segments
from .interfaces import Backend
from .ring import ByteViews

__all__ = ["CHOICES", "Choices", "Sampler", "choose_codecs", "layout_key", "pick", "sample_ranges"]

Specs = list[dict]
# {stream index: its candidate specs} -> {stream index: stored bytes of its sample under each spec}
SizeOf = Callable[[dict[int, Specs]], dict[int, list[int]]]

_PIECE_ALIGN = 4096  # piece offsets: whole elements of any dtype, and the ring's alignment


def pick(specs: Specs, sizes: list[int]) -> dict:
    """The spec whose sample stored fewest bytes; the earliest of those on a tie."""
    return specs[min(range(len(specs)), key=lambda k: (sizes[k], k))]


def sample_ranges(nbytes: int, pieces: int = CODEC_SAMPLE_PIECES,
                  piece: int = CODEC_SAMPLE_PIECE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the sample's pieces in a stream of `nbytes`: `pieces` pieces of `piece`
    bytes, each around the middle of one of `pieces` equal parts of the stream, at offsets that are
    multiples of 4 KiB; a stream of at most pieces x piece bytes is its own sample (cut into pieces);
    a stream shorter than one piece has none (it is not worth a choice)."""
    if nbytes < piece:
        return []
    if nbytes <= pieces * piece:
        return [(o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]
    # Part k's middle is (2k + 1) nbytes / 2 pieces; the last piece ends nbytes / 2 pieces - piece / 2
    # > 0 bytes before the stream does, rounding down only moves it earlier.
    return [(max(0, (2 * k + 1) * nbytes // (2 * pieces) - piece // 2) // _PIECE_ALIGN * _PIECE_ALIGN, piece)
            for k in range(pieces)]


def layout_key(plan: Plan, s: int, specs: Specs) -> tuple:
    """What a choice is kept under: the stream's dtype, its candidate specs (nvCOMP's version
    included), and its tensors' keys and shapes in order."""
    stream = plan.streams[s]
    return (stream.dtype, json.dumps(specs, sort_keys=True),
            tuple((plan.tensors[i].key, plan.tensors[i].shape) for i in stream.tensors))


class Choices:
    """Choices by layout_key, the newest `size` layouts kept. Saves run on background threads too
    (save_async), hence the lock."""

    def __init__(self, size: int = CODEC_CHOICE_CACHE):
        self._size = size
        self._kept: OrderedDict[tuple, dict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> dict | None:
        with self._lock:
            spec = self._kept.get(key)
            if spec is not None:
                self._kept.move_to_end(key)
            return None if spec is None else dict(spec)

    def put(self, key: tuple, spec: dict) -> None:
        with self._lock:
            self._kept[key] = dict(spec)
            self._kept.move_to_end(key)
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


CHOICES = Choices()  # the process's: every save shares it


def choose_codecs(plan: Plan, candidates_of: Callable[[str], Specs], size_of: SizeOf,
                  choices: Choices = CHOICES) -> int:
    """Give each stream of `plan` that has more than one candidate spec (candidates_of(dtype), its
    planned spec first) and a sample (sample_ranges) the candidate that stores its sample smallest:
    from `choices` where its layout was chosen before, else measured by `size_of`, all such streams
    in one call. Returns how many streams were measured (0: nothing was compressed)."""
    todo: dict[int, tuple[Specs, tuple]] = {}
    for s, stream in enumerate(plan.streams):
        specs = candidates_of(stream.dtype)
        if len(specs) < 2 or not sample_ranges(stream.nbytes):
            continue
        key = layout_key(plan, s, specs)
        known = choices.get(key)
        if known is not None:
            stream.codec = known
        else:
            todo[s] = (specs, key)
    if todo:
        sizes = size_of({s: specs for s, (specs, _) in todo.items()})
        for s, (specs, key) in todo.items():
            plan.streams[s].codec = pick(specs, sizes[s])
            choices.put(key, plan.streams[s].codec)
    return len(todo)


class Sampler:
    """choose_codecs' size_of on the save's own backend: each stream's pieces gathered from
    `tensors` (plan.tensors[i]'s tensor is tensors[i]) by the backend's gather, and compressed by
    its encode, each piece as one chunk, under each candidate spec. A piece that would not shrink
    counts its logical bytes (the ring would store it raw). Call it after backend.begin(): its work
    is then ordered after the caller's on the tensors, as the ring's is."""

    def __init__(self, backend: Backend, plan: Plan, tensors):
        self._backend, self._plan, self._tensors = backend, plan, tensors

    def pieces(self, streams) -> list[Chunk]:
        """The sample pieces of `streams` (stream indices), as chunks numbered from 0."""
        plan, out = self._plan, []
        for s in streams:
            members = [i for i in plan.streams[s].tensors if plan.tensors[i].nbytes]
            starts = [plan.tensors[i].offset for i in members]
            for offset, length in sample_ranges(plan.streams[s].nbytes):
                first = max(0, bisect.bisect_right(starts, offset) - 1)  # the tensor the piece starts in
                segs, _ = segments(plan.tensors, members, first, offset, length)
                out.append(Chunk(len(out), s, offset, length, segs))
        return out

    def __call__(self, todo: dict[int, Specs]) -> dict[int, list[int]]:
        be, plan = self._backend, self._plan
        pieces = self.pieces(todo)
        gather = be.gatherer(Plan(plan.tensors, plan.streams, pieces), ByteViews(self._tensors))
        longest = max(c.length for c in pieces)
        staging = be.empty(longest)
        out = be.empty(max(be.max_stored(spec, longest) for specs in todo.values() for spec in specs))
        sizes = {s: [0] * len(specs) for s, specs in todo.items()}
        for c in pieces:
            for k, spec in enumerate(todo[c.stream]):
                src, shuffled = gather(c, staging[:c.length], spec)  # once per spec: an encoder may overwrite its scratch
                stored, _ = be.encode(spec, src, out, staging, shuffled)
                sizes[c.stream][k] += c.length if stored < 0 else stored
        return sizes
