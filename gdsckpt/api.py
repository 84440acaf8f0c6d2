"""Public API: save, load, load_into, open.

save:   state -> tree -> plan -> ring (gather, compress, write; format.FileWriter places records,
        then writes index and footer) -> fsync, rename
load:   footer -> index (validated) -> ring (read, verify, decode into the tensors) -> tree
"""

from __future__ import annotations

import datetime
import os
import stat
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import codecs
from . import format as fmt
from ._version import __version__
from .backend import choose, make_backend, nvcomp_version
from .checksum import checksum
from .defaults import CHUNK_BYTES, RING_DEPTH
from .dtypes import BY_NAME, name_of
from .errors import CheckpointFormatError, StateMismatchError, VersionError
from .plan import make_plan
from .ring import ChunkFile, Timings, read_chunks, verify_chunk, write_chunks
from .storage import commit, pread_exact, temp_path_for
from .tree import flatten, unflatten


@dataclass
class Stats:
    """What one save or restore did. `io_path` is the path the bytes really took: gds, compat or cpu."""

    op: str
    path: str
    backend: str
    io_path: str
    logical_bytes: int
    stored_bytes: int
    file_bytes: int
    chunks: int
    chunk_bytes: int
    ring_depth: int
    seconds: float
    stages: dict = field(default_factory=dict)
    latencies: list = field(default_factory=list, repr=False)
    streams: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """stored / logical: 0.85 means 15% of the bytes saved."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 1.0

    @property
    def gbps(self) -> float:
        return self.logical_bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("latencies")
        d["ratio"] = self.ratio
        d["gbps"] = self.gbps
        return d


def save(state, path, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH,
         io: str = "auto", io_threads: int | None = None, backend: str | None = None) -> Stats:
    """Save `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

    Durable on return: the file is fsync'd and renamed over `path`, and the directory
    fsync'd; an existing checkpoint at `path` is replaced only by a complete one.
    codec: "auto" (typed ANS on the GPU, zstd on the CPU), "ans", "bitcomp", "zstd", "raw",
    or {dtype name: codec}. io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend).
    """
    return _save(state, _NewFile(Path(path) if path is not None else None), codec=codec, chunk_bytes=chunk_bytes,
                 ring_depth=ring_depth, io=io, io_threads=io_threads, backend=backend)


def save_through(state, sink: ChunkFile, **options) -> Stats:
    """The save pipeline into any ChunkFile, with `save`'s options: gdsckpt-bench's targets with
    storage removed (`sink.fd` None: records are placed but no header, index or footer written)."""
    return _save(state, _Sink(sink), **options)


class _NewFile:
    """A save's destination: a fresh temporary beside `path`, renamed over it once durable."""

    def __init__(self, path: Path):
        self.path = path
        self.label = str(path)

    def open(self, be) -> ChunkFile:
        self._tmp = temp_path_for(self.path)
        return be.open(self._tmp, "w")

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
    skeleton, leaves = flatten(state)
    kind = choose(any(l.tensor.is_cuda for l in leaves), backend)
    chunk_bytes = chunk_bytes or CHUNK_BYTES[kind]
    if chunk_bytes <= 0 or chunk_bytes % fmt.ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {fmt.ALIGN}, got {chunk_bytes}")
    if ring_depth < 2:
        raise ValueError(f"ring_depth must be at least 2 so that compression overlaps I/O, got {ring_depth}")
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


def _writer_meta(be, chunk_bytes: int) -> dict:
    return {"library": f"gdsckpt {__version__}", "nvcomp": be.nvcomp_version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "writer": {"backend": be.name, "io_path": be.io_path, "chunk_bytes": chunk_bytes,
                       "torch": torch.__version__}}


def _stream_stats(plan, records) -> list[dict]:
    out = [{"dtype": s.dtype, "codec": s.codec["name"], "logical_bytes": s.nbytes, "stored_bytes": 0,
            "raw_chunks": 0, "tensors": len(s.tensors)} for s in plan.streams]
    for c, r in zip(plan.chunks, records):
        out[c.stream]["stored_bytes"] += r.stored
        out[c.stream]["raw_chunks"] += r.raw
    for s in out:
        s["ratio"] = s["stored_bytes"] / s["logical_bytes"] if s["logical_bytes"] else 1.0
    return out


# ---------------------------------------------------------------- reading


class Checkpoint:
    """A checkpoint opened for reading: the validated index, and tensors read on demand.

    Only the footer and index are read on open; `get_tensor` reads just the chunks
    that hold that tensor.
    """

    def __init__(self, path, *, backend: str | None = None, io: str = "auto", ring_depth: int = RING_DEPTH,
                 io_threads: int | None = None):
        self.path = Path(path)
        self.ring_depth = ring_depth
        # The file stays open: every later read goes to this file even if a save replaces the path.
        # O_NONBLOCK: a FIFO given by mistake must not hang the open.
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointFormatError("not a regular file, so not a checkpoint", path=self.path)
            self._identity = (st.st_dev, st.st_ino)
            off, length, ck = fmt.read_footer(lambda n, o: pread_exact(fd, n, o), st.st_size, self.path)
            raw = pread_exact(fd, length, off)
            self.index = fmt.parse_index(raw, ck, off, self.path)
        except BaseException:
            self._closer()
            raise
        self._check_nvcomp()
        self._backend_choice, self._io, self._io_threads = backend, io, io_threads
        self._by_key = {t.key: i for i, t in enumerate(self.index.plan.tensors)}
        self.last_stats: Stats | None = None

    # -- metadata
    def keys(self) -> list[str]:
        return list(self._by_key)

    def __contains__(self, key) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def info(self, key: str) -> dict:
        i = self._entry(key)
        t = self.index.plan.tensors[i]
        s = self.index.plan.streams[t.stream]
        return {"dtype": t.dtype, "shape": t.shape, "nbytes": t.nbytes, "codec": s.codec["name"],
                "device": self.index.devices[i]}

    @property
    def metadata(self) -> dict:
        return self.index.meta

    def streams(self) -> list[dict]:
        return _stream_stats(self.index.plan, self.index.records)

    # -- data
    def get_tensor(self, key: str, device=None) -> torch.Tensor:
        return self.read([key], device)[key]

    def read(self, keys, device=None) -> dict[str, torch.Tensor]:
        """New tensors for `keys`, on `device` (None: where each was saved from), reading only
        the chunks that hold them."""
        wanted = [self._entry(k) for k in keys]
        out = {i: self._new_tensor(i, device) for i in wanted}
        self._read(out)
        return {self.index.plan.tensors[i].key: t for i, t in out.items()}

    def read_into(self, targets: dict) -> Stats:
        """Decode `targets[key]` in place for each key (shape and dtype as in the checkpoint)."""
        into = {}
        for key, tgt in targets.items():
            i = self._entry(key)
            t = self.index.plan.tensors[i]
            if name_of(tgt.dtype) != t.dtype or tuple(tgt.shape) != t.shape:
                raise StateMismatchError(f"{self.path}: tensor {t.key!r} is {t.dtype}{list(t.shape)} in the "
                                         f"checkpoint but {name_of(tgt.dtype)}{list(tgt.shape)} in the target")
            into[i] = tgt
        self._read(into)
        return self.last_stats

    def load(self, device=None):
        tensors = self.read(self.keys(), device)
        return unflatten(self.index.skeleton, list(tensors.values()))

    def load_into(self, state, *, strict: bool = True) -> Stats:
        _, leaves = flatten(state)
        targets = {l.key: l.tensor for l in leaves}
        missing = [k for k in self._by_key if k not in targets]
        extra = [k for k in targets if k not in self._by_key]
        if strict and (missing or extra):
            raise StateMismatchError(f"{self.path}: keys differ from the checkpoint's: missing from the target "
                                     f"{missing[:5]}, not in the checkpoint {extra[:5]}")
        return self.read_into({k: targets[k] for k in self._by_key if k in targets})

    def _entry(self, key: str) -> int:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in {str(self.path)!r}") from None

    def _check_nvcomp(self):
        for s in self.index.plan.streams:
            if s.codec["name"] in codecs.NVCOMP_CODECS:
                mine = nvcomp_version()
                theirs = s.codec["nvcomp"]
                if mine and mine.split(".")[0] != theirs.split(".")[0]:
                    raise VersionError(f"{s.codec['name']} chunks were written by nvCOMP {theirs}, whose bitstream "
                                       f"nvCOMP {mine} cannot read; read it with nvCOMP {theirs.split('.')[0]}.x "
                                       "and `gdsckpt convert --codec zstd`", path=self.path)

    def _new_tensor(self, i: int, device) -> torch.Tensor:
        t = self.index.plan.tensors[i]
        dev = torch.device(device if device is not None else self.index.devices[i])
        if dev.type == "cuda" and not torch.cuda.is_available():
            dev = torch.device("cpu")  # saved on a GPU, read where there is none
        return torch.empty(t.shape, dtype=BY_NAME[t.dtype], device=dev)

    def _read(self, out: dict[int, torch.Tensor]) -> None:
        """Fill `out[i]` (tensor i's destination) from the chunks that hold them."""
        t_start = time.perf_counter()
        plan, records = self.index.plan, self.index.records
        # Decode into contiguous memory; a non-contiguous target gets a temporary, copied back at the end.
        work = {i: (v if v.is_contiguous() else torch.empty_like(v, memory_format=torch.contiguous_format))
                for i, v in out.items()}
        views = [None] * len(plan.tensors)
        for i, v in work.items():
            views[i] = v.reshape(-1).view(torch.uint8)
        chunk_ids = [c.index for c in plan.chunks if any(views[s.tensor] is not None for s in c.segments)]
        timings = Timings()
        with make_backend(self._backend_kind(out), io=self._io, io_threads=self._io_threads) as be:
            self._check_decoders(be, chunk_ids)
            file = be.open(self._reopen_path(), "r")
            try:
                self._same_file(file.fd)
                be.begin()
                read_chunks(self.index, chunk_ids, views, be, file, self.ring_depth, timings, self.path)
                be.finish()
            finally:
                file.close()
            for i, v in work.items():
                if v is not out[i]:
                    out[i].copy_(v)
            stored = sum(records[c].stored for c in chunk_ids)
            self.last_stats = Stats("load", str(self.path), be.name, be.io_path,
                                    sum(plan.chunks[c].length for c in chunk_ids), stored, stored, len(chunk_ids),
                                    max((plan.chunks[c].length for c in chunk_ids), default=0), self.ring_depth,
                                    time.perf_counter() - t_start, dict(timings.stages), timings.latencies, [],
                                    be.memory())

    def _backend_kind(self, out: dict) -> str:
        """The GPU where a chunk needs nvCOMP or a destination is on a GPU (unless told otherwise)."""
        plan = self.index.plan
        needs_nvcomp = any(not rec.raw and plan.streams[c.stream].codec["name"] in codecs.NVCOMP_CODECS
                           for c, rec in zip(plan.chunks, self.index.records))
        return choose(needs_nvcomp or any(v.is_cuda for v in out.values()), self._backend_choice)

    def _check_decoders(self, be, chunk_ids) -> None:
        """Before reading a byte: every chunk asked for has a decoder here."""
        plan = self.index.plan
        for ci in chunk_ids:
            spec = plan.streams[plan.chunks[ci].stream].codec
            if not self.index.records[ci].raw and not be.can_decode(spec):
                raise codecs.no_cpu_decoder(spec, self.path)

    def verify(self, deep: bool = False) -> dict:
        """Check every chunk's checksum on the CPU, reading chunk by chunk (no GPU needed).
        deep=True also decodes every chunk (on the GPU where a codec needs one) into fresh
        tensors. Raises ChecksumError / CheckpointFormatError naming the file, key and chunk."""
        fd = os.open(self._reopen_path(), os.O_RDONLY)
        try:
            self._same_file(fd)
            for c, rec in zip(self.index.plan.chunks, self.index.records):
                data = pread_exact(fd, rec.stored, rec.file_offset)
                verify_chunk(len(data), checksum(data), rec, self.path,
                             self.index.plan.tensors[c.segments[0].tensor].key, c.index)
        finally:
            os.close(fd)
        if deep:
            self.load(device="cpu" if all(self._cpu_decodable()) else None)
        return {"chunks": len(self.index.records), "tensors": len(self.index.plan.tensors),
                "stored_bytes": sum(r.stored for r in self.index.records), "deep": deep}

    def _cpu_decodable(self):
        return (r.raw or codecs.cpu_can_decode(self.index.plan.streams[c.stream].codec)
                for c, r in zip(self.index.plan.chunks, self.index.records))

    def _reopen_path(self) -> Path:
        """The file this Checkpoint opened, by a path a concurrent save's rename cannot redirect
        (/proc/self/fd on Linux); the path itself once closed, or where there is no /proc."""
        if self._closer.alive:
            p = Path(f"/proc/self/fd/{self._fd}")
            if p.exists():
                return p
        return self.path

    def _same_file(self, fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._identity:
            raise CheckpointFormatError("the file was replaced since it was opened: open it again", path=self.path)

    def close(self):
        self._closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open(path, **options) -> Checkpoint:  # noqa: A001 - mirrors safetensors.safe_open / builtins.open
    """Open a checkpoint lazily: keys(), info(key), get_tensor(key), read(keys), load()."""
    return Checkpoint(path, **options)


def load(path, *, device=None, **options):
    """Load a checkpoint. device=None puts each tensor where it was saved from (cuda tensors on the
    current CUDA device; on the CPU where there is no GPU); "cpu" or "cuda:N" puts all there."""
    return Checkpoint(path, **options).load(device)


def load_into(path, state, *, strict: bool = True, **options) -> Stats:
    """Fill the tensors of `state` (e.g. model.state_dict()) in place from `path`: no second
    full-size allocation. A missing key, or a shape or dtype mismatch, is a StateMismatchError
    naming the key, raised before anything is read."""
    return Checkpoint(path, **options).load_into(state, strict=strict)
