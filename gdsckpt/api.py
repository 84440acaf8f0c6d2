"""Public API: save, load, load_into, open.

save:   state -> tree -> plan -> ring (gather, compress, write; format.FileWriter places records,
        then writes index and footer) -> fsync, rename
load:   gdsckpt/reader.py: source -> footer -> index (validated) -> ring (read, verify, decode into
        the tensors) -> tree
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch

from . import codecs
from . import format as fmt
from . import reader
from ._version import __version__
from .backend import check_gds as _check_gds, check_io as _check_io, choose, make_backend
from .defaults import CHUNK_BYTES, RING_DEPTH
from .dtypes import BY_NAME, name_of
from .plan import make_plan
from .reader import Checkpoint
from .ring import ChunkFile, Timings, write_chunks
from .stats import Stats, stream_stats as _stream_stats
from .storage import adopt_mode, commit, save_target, temp_path_for, user_path
from .tree import flatten


def save(state, path, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH,
         io: str = "auto", io_threads: int | None = None, backend: str | None = None) -> Stats:
    """Save `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

    Durable on return: the file is fsync'd and renamed over `path`, and the directory
    fsync'd; an existing checkpoint at `path` is replaced only by a complete one.
    codec: "auto" (typed ANS on the GPU, zstd on the CPU), "ans", "bitcomp", "zstd", "raw",
    or {dtype name: codec}. io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend).
    """
    return _save(state, _NewFile(user_path(path, "save")), codec=codec, chunk_bytes=chunk_bytes,
                 ring_depth=ring_depth, io=io, io_threads=io_threads, backend=backend)


def save_through(state, sink: ChunkFile, **options) -> Stats:
    """The save pipeline into any ChunkFile, with `save`'s options: gdsckpt-bench's targets with
    storage removed (`sink.fd` None: records are placed but no header, index or footer written)."""
    return _save(state, _Sink(sink), **options)


class _NewFile:
    """A save's destination: a fresh temporary beside the file `path` names (through a symlink:
    beside its target), renamed over that file once durable. Every error names `path`, the
    user's path, not the hidden temporary; a directory, a missing parent or a symlink loop is
    refused here, before the state is even walked."""

    def __init__(self, path: Path):
        self.label = str(path)
        self.path = save_target(path)

    def open(self, be) -> ChunkFile:
        self._tmp = temp_path_for(self.path)
        try:
            file = be.open(self._tmp, "w")
        except OSError as e:  # an unwritable or full directory: before a byte of the checkpoint is written
            self._tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"{e.strerror}: cannot create a file in {str(self.path.parent)!r} to save into",
                          self.label) from None
        try:
            adopt_mode(file.fd, self.path)
        except OSError as e:
            file.close()
            self._tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"{e.strerror}: cannot give the new file the mode of the one it replaces",
                          self.label) from None
        return file

    def commit(self, file: ChunkFile) -> None:
        os.fsync(file.fd)
        file.close()
        commit(self._tmp, self.path)

    def abort(self, file: ChunkFile, error: BaseException) -> None:
        file.close()
        self._tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno is not None:  # a full disk, an I/O error: say which save
            raise OSError(error.errno, f"{error.strerror} while saving (the temporary file was removed)",
                          self.label) from error


class _Sink:
    label = "<null>"

    def __init__(self, sink: ChunkFile):
        self._sink = sink

    def open(self, be) -> ChunkFile:
        return self._sink

    def commit(self, file: ChunkFile) -> None:
        pass

    def abort(self, file: ChunkFile, error: BaseException) -> None:
        pass


def _save(state, dest, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH,
          io: str = "auto", io_threads: int | None = None, backend: str | None = None) -> Stats:
    t_start = time.perf_counter()
    _check_codec(codec)
    _check_io(io, io_threads)
    skeleton, leaves = flatten(state)
    kind = choose(any(l.tensor.is_cuda for l in leaves), backend)
    _check_gds(io, kind, "save")
    chunk_bytes = chunk_bytes or CHUNK_BYTES[kind]
    if not _is_int(chunk_bytes) or chunk_bytes <= 0 or chunk_bytes % fmt.ALIGN or chunk_bytes > fmt.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {fmt.ALIGN} of at most {fmt.MAX_CHUNK_BYTES} "
                         f"(a reader refuses larger chunks), got {chunk_bytes!r}")
    if not _is_int(ring_depth) or ring_depth < 2:
        raise ValueError(f"ring_depth must be at least 2 so that compression overlaps I/O, got {ring_depth!r}")
    with make_backend(kind, io=io, io_threads=io_threads) as be:
        specs = [(l.key, name_of(l.tensor.dtype), tuple(l.tensor.shape), l.tensor.nbytes) for l in leaves]
        plan = make_plan(specs, lambda dtype: codecs.resolve(codec, dtype, gpu=kind == "gpu",
                                                             nvcomp_version=be.nvcomp_version), chunk_bytes)
        tensors = [l.tensor for l in leaves]
        timings = Timings()
        file = dest.open(be)
        try:
            be.begin()
            # A destination may lay the file out itself (save_async's pool: host_snapshot.PoolDestination)
            layout = getattr(dest, "make_layout", fmt.FileWriter)(
                file.fd, _writer_meta(be, chunk_bytes), skeleton, ["cuda" if x.is_cuda else "cpu" for x in tensors],
                plan)
            records = write_chunks(plan, tensors, be, file, layout, ring_depth, timings)
            be.finish()
            t = time.perf_counter()
            dest.commit(file)
            timings.add("commit", t)
        except BaseException as e:
            dest.abort(file, e)
            raise
        return Stats("save", dest.label, be.name, be.io_path, plan.logical_bytes, sum(r.stored for r in records),
                     layout.file_bytes if layout.fd is not None else 0, len(plan.chunks), chunk_bytes, ring_depth,
                     time.perf_counter() - t_start, dict(timings.stages), timings.latencies,
                     _stream_stats(plan, records), be.memory())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_codec(codec) -> None:
    """codec: "auto", a codec name, or {dtype name: "auto" or a codec name}; else a ValueError,
    before anything is written (a typo must not fall back to a default silently)."""
    names = ("auto",) + codecs.ALL_CODECS
    if isinstance(codec, str):
        if codec not in names:
            raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(names)}, or a dict of dtype name to one")
        return
    if not isinstance(codec, dict):
        raise ValueError(f"codec must be one of {', '.join(names)} or a dict of dtype name to one, not {codec!r}")
    for dtype, name in codec.items():
        if dtype not in BY_NAME:
            raise ValueError(f"codec: {dtype!r} is not a dtype name gdsckpt stores ({', '.join(BY_NAME)})")
        if name not in names:
            raise ValueError(f"codec for {dtype}: unknown codec {name!r}; choose one of {', '.join(names)}")


def _writer_meta(be, chunk_bytes: int) -> dict:
    return {"library": f"gdsckpt {__version__}", "nvcomp": be.nvcomp_version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "writer": {"backend": be.name, "io_path": be.io_path, "chunk_bytes": chunk_bytes,
                       "torch": torch.__version__}}


# ---------------------------------------------------------------- reading (gdsckpt/reader.py)


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
