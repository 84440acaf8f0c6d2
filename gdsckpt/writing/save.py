"""Saving: the one pipeline every save goes through.

    skeleton, leaves = tree.flatten(state)                 # once, by the caller
    stats = save_flat(skeleton, leaves, destination, SaveOptions(codec="zstd"))

`save_flat` picks the backend, plans the streams and chunks, chooses the codec of the streams
codec="auto" leaves a choice to (codec_choice.py: on the GPU, typed or byte-plane ANS from a
sample), runs the ring (gather, compress, checksum, write) into a `Destination` and commits it. Its callers: `gdsckpt.save` (a `NewFile`),
the bench's storage-removed targets (a `Sink`), `save_async` and DCP's compressed staging (the
host pool: host_snapshot.PoolDestination), GdsckptWriter's rank files, and through `save` and
`save_async` the checkpoint manager.

Its options, `SaveOptions` and the snapshot modes (`Snapshot`), are gdsckpt/writing/options.py's (public through gdsckpt.options);
they are imported here too, where the pipeline's callers have always found them.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch

from gdsckpt.engine import codec_choice
from gdsckpt import codecs
from gdsckpt.core import collector
from gdsckpt.format import file as fmt
from gdsckpt._version import __version__
from gdsckpt.engine.backend import check_gds, choose, make_backend
from gdsckpt.core.dtypes import name_of
from .options import SaveOptions, Snapshot, check_codec, check_save_options, is_int
from gdsckpt.format.plan import PLANS, Plan
from gdsckpt.engine.interfaces import Backend, ChunkFile
from .interfaces import Destination
from gdsckpt.engine.ring import Timings, write_chunks
from gdsckpt.stats import Stats, stream_stats
from gdsckpt.core.storage import AtomicFile, save_target
from gdsckpt.format.tree import Leaf

__all__ = ["SaveOptions", "Snapshot", "Destination", "NewFile", "Sink", "save_flat", "choose_codecs_ahead",
           "backend_kind", "tensor_specs", "check_codec", "check_save_options", "is_int"]


# ---------------------------------------------------------------- destinations


class NewFile:
    """A new file at `path` (through a symlink: beside its target), written as a temporary and
    renamed over the file once durable (storage.AtomicFile). Every error names `path`, the user's
    path, not the hidden temporary; a directory, a missing parent or a symlink loop is refused on
    construction, before the state is even walked."""

    def __init__(self, path: Path):
        self.label = str(path)
        self.path = save_target(path)
        self._file: AtomicFile | None = None

    def open(self, be: Backend) -> ChunkFile:
        f = AtomicFile(self.path)
        try:
            f.create(lambda tmp: be.open(tmp, "w"))
        except OSError as e:  # an unwritable or full directory: before a byte of the checkpoint is written
            raise OSError(e.errno, f"{e.strerror}: cannot create a file in {str(self.path.parent)!r} to save into",
                          self.label) from None
        try:
            f.adopt_mode()
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror}: cannot give the new file the mode of the one it replaces",
                          self.label) from None
        self._file = f
        return f.file

    def layout(self, fd, meta: dict, skeleton: dict, devices: list[str], plan: Plan) -> fmt.FileWriter:
        return fmt.FileWriter(fd, meta, skeleton, devices, plan)

    def commit(self, file: ChunkFile) -> None:
        self._file.commit()

    def abort(self, file: ChunkFile, error: BaseException) -> None:
        self._file.abort()
        if isinstance(error, OSError) and error.errno is not None:  # a full disk, an I/O error: say which save
            raise OSError(error.errno, f"{error.strerror} while saving (the temporary file was removed)",
                          self.label) from error


class Sink:
    """Any ChunkFile as a destination, with nothing to commit: gdsckpt-bench's targets with
    storage removed (`sink.fd` None: records are placed but no header, index or footer written)."""

    label = "<null>"

    def __init__(self, sink: ChunkFile):
        self._sink = sink

    def open(self, be: Backend) -> ChunkFile:
        return self._sink

    def layout(self, fd, meta: dict, skeleton: dict, devices: list[str], plan: Plan) -> fmt.FileWriter:
        return fmt.FileWriter(fd, meta, skeleton, devices, plan)

    def commit(self, file: ChunkFile) -> None:
        pass

    def abort(self, file: ChunkFile, error: BaseException) -> None:
        pass


# ---------------------------------------------------------------- the pipeline


def backend_kind(leaves: list[Leaf], options: SaveOptions) -> str:
    """The backend a save of `leaves` runs on ("gpu" or "cpu"); GDSUnavailableError for io="gds" without it."""
    kind = choose(any(l.tensor.is_cuda for l in leaves), options.backend)
    check_gds(options.io, kind, "save")
    return kind


def tensor_specs(leaves: list[Leaf]) -> list[tuple]:
    """plan.make_plan's (key, dtype name, shape, bytes) per leaf."""
    return [(l.key, name_of(l.tensor.dtype), tuple(l.tensor.shape), l.tensor.nbytes) for l in leaves]


@collector.paused()  # the save's objects meet one young collection, at its end
def save_flat(skeleton: dict, leaves: list[Leaf], destination: Destination, options: SaveOptions, *,
              started: float | None = None) -> Stats:
    """Save a flattened state (tree.flatten's skeleton and leaves) into `destination`.

    The backend is options.backend, or the GPU where a leaf is a CUDA tensor and the GPU stack is
    usable. Returns once destination.commit returned. started: when the caller's save began
    (perf_counter), for Stats.seconds; default now."""
    t_start = time.perf_counter() if started is None else started
    kind = backend_kind(leaves, options)
    chunk_bytes = options.chunk_bytes_for(kind)
    with make_backend(kind, io=options.io, io_threads=options.io_threads) as be:
        plan = _plan(leaves, options, kind, be)
        tensors = [l.tensor for l in leaves]
        timings = Timings()
        file = destination.open(be)
        try:
            be.begin()
            t = time.perf_counter()
            if _choose_codecs(plan, tensors, options, kind, be):
                timings.add("codec_choice", t)  # only where a sample was compressed: steady saves reuse the choice
            layout = destination.layout(file.fd, _writer_meta(be, chunk_bytes), skeleton,
                                        ["cuda" if x.is_cuda else "cpu" for x in tensors], plan)
            records = write_chunks(plan, tensors, be, file, layout, options.ring_depth, timings)
            be.finish()
            t = time.perf_counter()
            destination.commit(file)
            timings.add("commit", t)
        except BaseException as e:
            destination.abort(file, e)
            raise
        return Stats("save", destination.label, be.name, be.io_path, plan.logical_bytes,
                     sum(r.stored for r in records), layout.file_bytes if layout.fd is not None else 0,
                     len(plan.chunks), chunk_bytes, options.ring_depth, time.perf_counter() - t_start,
                     dict(timings.stages), timings.latencies, stream_stats(plan, records), be.memory())


def choose_codecs_ahead(leaves: list[Leaf], options: SaveOptions) -> int:
    """codec="auto"'s per-stream choice for a state of `leaves`, made now from their bytes and kept
    (codec_choice.CHOICES), so that the state's first save samples nothing (gdsckpt.reserve's
    warm-up). The streams measured; 0 where there was nothing to choose or it was chosen before."""
    kind = backend_kind(leaves, options)
    with make_backend(kind, io=options.io, io_threads=options.io_threads) as be:
        be.begin()
        chosen = _choose_codecs(_plan(leaves, options, kind, be), [l.tensor for l in leaves], options, kind, be)
        be.finish()
    return chosen


def _plan(leaves: list[Leaf], options: SaveOptions, kind: str, be: Backend) -> Plan:
    def planned_codec(dtype: str) -> dict:
        return codecs.resolve(options.codec, dtype, gpu=kind == "gpu", nvcomp_version=be.nvcomp_version)
    return PLANS.get(tensor_specs(leaves), planned_codec, options.chunk_bytes_for(kind))


def _choose_codecs(plan: Plan, tensors: list, options: SaveOptions, kind: str, be: Backend) -> int:
    """codec_choice.choose_codecs for `plan` on the save's backend (after be.begin())."""
    def candidates(dtype: str) -> list[dict]:
        return codecs.candidates(options.codec, dtype, gpu=kind == "gpu", nvcomp_version=be.nvcomp_version)
    return codec_choice.choose_codecs(plan, candidates, codec_choice.Sampler(be, plan, tensors))


def _writer_meta(be: Backend, chunk_bytes: int) -> dict:
    return {"library": f"gdsckpt {__version__}", "nvcomp": be.nvcomp_version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "writer": {"backend": be.name, "io_path": be.io_path, "chunk_bytes": chunk_bytes,
                       "torch": torch.__version__}}
