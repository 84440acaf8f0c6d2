"""Public API: save, load, load_into, open.

save:   state -> tree -> save.save_flat (plan -> ring: gather, compress, write; format.FileWriter
        places records, then writes index and footer) -> fsync, rename
load:   reader.py: source -> footer -> index (validated) -> ring (read, verify, decode into the
        tensors) -> tree
"""

from __future__ import annotations

import time

from .reading import reader
from .writing.async_save import wait_for_saves_to
from .core.defaults import RING_DEPTH
from .reading.reader import Checkpoint
from .engine.ring import ChunkFile
from .writing.save import NewFile, SaveOptions, Sink, save_flat
from .stats import Stats
from .core.storage import user_path
from .format.tree import flatten

__all__ = ["save", "save_through", "load", "load_into", "open", "Checkpoint", "Stats"]


def save(state, path, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH,
         io: str = "auto", io_threads: int | None = None, backend: str | None = None) -> Stats:
    """Save `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

    Durable on return: the file is fsync'd and renamed over `path`, and the directory
    fsync'd; an existing checkpoint at `path` is replaced only by a complete one. A save_async to
    `path` still in flight is waited for first (calls to one path commit in call order).
    codec: "auto" (typed or byte-plane ANS per stream on the GPU, zstd on the CPU), "ans",
    "ans-planes", "bitcomp", "zstd", "raw", or {dtype name: codec}.
    io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend).
    """
    started = time.perf_counter()
    target = user_path(path, "save")  # a bad path: refused before anything else
    # A save_async to the same path still in flight commits first: else its older state would be
    # renamed over this one after this call said it was durable.
    wait_for_saves_to(target)
    destination = NewFile(target)
    options = SaveOptions(codec=codec, chunk_bytes=chunk_bytes, ring_depth=ring_depth, io=io,
                          io_threads=io_threads, backend=backend)
    skeleton, leaves = flatten(state, saving=True)
    return save_flat(skeleton, leaves, destination, options, started=started)


def save_through(state, sink: ChunkFile, **options) -> Stats:
    """The save pipeline into any ChunkFile, with `save`'s options: gdsckpt-bench's targets with
    storage removed (`sink.fd` None: records are placed but no header, index or footer written)."""
    started = time.perf_counter()
    options = SaveOptions(**options)
    skeleton, leaves = flatten(state)
    return save_flat(skeleton, leaves, Sink(sink), options, started=started)


# ---------------------------------------------------------------- reading (gdsckpt/reading/reader.py)


def open(path, **options) -> Checkpoint:  # noqa: A001 - mirrors safetensors.safe_open / builtins.open
    """Open a checkpoint lazily: keys(), info(key), get_tensor(key), read(keys), load().
    `path`: a file, or an object in an S3-compatible store ("s3://bucket/key": ranged GETs only).
    options: backend, io, ring_depth, io_threads, and trusted=False for a file you did not write
    (no chunk reaches a GPU decoder here before a child process has decoded it)."""
    return reader.open(path, **options)


def load(path, *, device=None, **options):
    """Load a checkpoint. device=None puts each tensor where it was saved from (cuda tensors on the
    current CUDA device; on the CPU where there is no GPU); "cpu" or "cuda:N" puts all there (a
    device that does not exist here is a ValueError). Tensors saved as one because they shared
    memory (tied weights) come back as one tensor in each of their places, as torch.save keeps
    them. trusted=False: see `open`."""
    return reader.load(path, device=device, **options)


def load_into(path, state, *, strict: bool = True, atomic: bool = False, **options) -> Stats:
    """Restore `path` into `state` (e.g. {"model": model, "optim": opt, "step": step}): tensors
    in place (no second full-size allocation), every stateful object (anything with state_dict()
    and load_state_dict(): module, optimizer, scheduler, torch.Generator, gdsckpt.RNG()) through
    its load_state_dict() with its saved state (a fresh optimizer included), and plain values
    written back into the dicts and lists that hold them. A missing key, or a shape or dtype
    mismatch, is a StateMismatchError naming the key, raised before anything is read
    (strict=False: what is missing on either side is left alone). Nothing changes in `state`
    until every tensor was read; then the objects' load_state_dict() are called and the values
    written back.

    If it fails part-way (a corrupt chunk, an I/O error), the error lists the keys it had already
    overwritten, wholly or in part (also as the exception's `.overwritten`; for an object, new
    tensors of its state may be among them); all other targets are untouched, no
    load_state_dict() was called and no value written back. atomic=True checks every chunk's checksum in
    one more read pass before the first byte reaches a target. A target tensor that several keys
    share (tied weights) is filled once. trusted=False: see `open`."""
    return reader.load_into(path, state, strict=strict, atomic=atomic, **options)
