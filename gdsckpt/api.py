"""Public API: save, load, load_into, open.

save:   state -> tree -> plan -> ring (gather, compress, write) -> index, footer, fsync, rename
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

from . import __version__, codecs
from . import format as fmt
from .backend import gpu_status, make_backend
from .dtypes import BY_NAME, name_of
from .checksum import checksum
from .errors import CheckpointFormatError, ChecksumError, StateMismatchError
from .plan import make_plan
from .ring import Timings, read_chunks, write_chunks
from .storage import commit, pread_exact, pwrite_all, temp_path_for
from .tree import flatten, unflatten

# From the H100 sweeps (bench/results/2026-11-22-h100-*): one nvCOMP call per chunk costs a
# fixed ~0.1 ms, so gather+compress reached 107-111 GB/s at 128 MiB and 151-165 GB/s at 256 MiB;
# the disk was the limit at every size, and a third slot gained nothing measurable there.
# Two slots of 256 MiB cost 835 MiB of GPU memory: one staging buffer + nvCOMP's worst-case output per slot.
DEFAULT_CHUNK_BYTES = {"gpu": 256 << 20, "cpu": 16 << 20}
DEFAULT_RING_DEPTH = 2


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


def _choose_backend(wants_gpu: bool, backend: str | None):
    if backend in ("cpu", "gpu"):
        return backend
    if backend not in (None, "auto"):
        raise ValueError(f"backend must be 'auto', 'gpu' or 'cpu', not {backend!r}")
    return "gpu" if wants_gpu and gpu_status()[0] else "cpu"


def save(state, path, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = DEFAULT_RING_DEPTH,
         io: str = "auto", io_threads: int | None = None, backend: str | None = None, _sink=None) -> Stats:
    """Save `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

    Durable on return: the file is fsync'd and renamed over `path`, and the directory
    fsync'd; an existing checkpoint at `path` is replaced only by a complete one.
    codec: "auto" (typed ANS on the GPU, zstd on the CPU), "ans", "bitcomp", "zstd", "raw",
    or {dtype name: codec}. io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend).
    """
    t_start = time.perf_counter()
    path = Path(path) if path is not None else None
    skeleton, leaves = flatten(state)
    kind = _choose_backend(any(l.tensor.is_cuda for l in leaves), backend)
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES[kind]
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
        if _sink is not None:  # gdsckpt-bench's null targets: the pipeline with storage removed
            be.begin()
            records = write_chunks(plan, tensors, be, _sink, ring_depth, timings)
            be.finish()
            return Stats("save", "<null>", be.name, be.io_path, plan.logical_bytes, sum(r.stored for r in records),
                         0, len(plan.chunks), chunk_bytes, ring_depth, time.perf_counter() - t_start,
                         dict(timings.stages), timings.latencies, _stream_stats(plan, records), be.memory())
        tmp = temp_path_for(path)
        file = be.open(tmp, "w")
        try:
            be.begin()
            pwrite_all(file.fd, fmt.header_bytes(), 0)
            file_end = 0

            def write_index(records):  # runs while the last chunks are still being written
                nonlocal file_end
                index_offset = fmt.align_up(records[-1].file_offset + records[-1].stored) if records \
                    else fmt.HEADER_SIZE
                meta = {"library": f"gdsckpt {__version__}", "nvcomp": be.nvcomp_version,
                        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "writer": {"backend": be.name, "io_path": be.io_path, "chunk_bytes": chunk_bytes,
                                   "torch": torch.__version__}}
                devices = ["cuda" if x.is_cuda else "cpu" for x in tensors]
                index = fmt.encode_index(meta, skeleton, devices, plan, records)
                pwrite_all(file.fd, index + fmt.footer_bytes(index_offset, index), index_offset)
                file_end = index_offset + len(index) + fmt.FOOTER_SIZE

            records = write_chunks(plan, tensors, be, file, ring_depth, timings, tail=write_index)
            t = time.perf_counter()
            os.fsync(file.fd)
            file.close()
            commit(tmp, path)
            timings.add("commit", t)
        except BaseException as e:
            file.close()
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno is not None:  # a full disk, an I/O error: say which save
                raise OSError(e.errno, f"{e.strerror} while saving (the temporary file was removed)",
                              str(path)) from e
            raise
        return Stats("save", str(path), be.name, be.io_path, plan.logical_bytes,
                     sum(r.stored for r in records), file_end, len(plan.chunks), chunk_bytes, ring_depth,
                     time.perf_counter() - t_start, dict(timings.stages), timings.latencies,
                     _stream_stats(plan, records), be.memory())


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

    def __init__(self, path, *, backend: str | None = None, io: str = "auto", ring_depth: int = DEFAULT_RING_DEPTH,
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
        t = self.index.plan.tensors[self._entry(key)]
        s = self.index.plan.streams[t.stream]
        return {"dtype": t.dtype, "shape": t.shape, "nbytes": t.nbytes, "codec": s.codec["name"],
                "device": self.index.devices[self._entry(key)]}

    @property
    def metadata(self) -> dict:
        return self.index.meta

    def streams(self) -> list[dict]:
        return _stream_stats(self.index.plan, self.index.records)

    # -- data
    def get_tensor(self, key: str, device=None) -> torch.Tensor:
        i = self._entry(key)
        return self._read([i], device)[i]

    def load(self, device=None):
        tensors = self._read(range(len(self.index.plan.tensors)), device)
        return unflatten(self.index.skeleton, tensors)

    def load_into(self, state, *, strict: bool = True) -> Stats:
        skeleton, leaves = flatten(state)
        targets = {l.key: l.tensor for l in leaves}
        plan = self.index.plan
        missing = [t.key for t in plan.tensors if t.key not in targets]
        extra = [k for k in targets if k not in self._by_key]
        if strict and (missing or extra):
            raise StateMismatchError(f"{self.path}: keys differ from the checkpoint's: missing from the target "
                                     f"{missing[:5]}, not in the checkpoint {extra[:5]}")
        dest = {}
        for i, t in enumerate(plan.tensors):
            if t.key not in targets:
                continue
            tgt = targets[t.key]
            if name_of(tgt.dtype) != t.dtype or tuple(tgt.shape) != t.shape:
                raise StateMismatchError(f"{self.path}: tensor {t.key!r} is {t.dtype}{list(t.shape)} in the "
                                         f"checkpoint but {name_of(tgt.dtype)}{list(tgt.shape)} in the target")
            dest[i] = tgt
        self._read(list(dest), None, into=dest)
        return self.last_stats

    def _entry(self, key: str) -> int:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in {str(self.path)!r}") from None

    def _check_nvcomp(self):
        for s in self.index.plan.streams:
            if s.codec["name"] in codecs.NVCOMP_CODECS:
                mine = _nvcomp_version()
                theirs = s.codec["nvcomp"]
                if mine and mine.split(".")[0] != theirs.split(".")[0]:
                    from .errors import VersionError
                    raise VersionError(f"{s.codec['name']} chunks were written by nvCOMP {theirs}, whose bitstream "
                                       f"nvCOMP {mine} cannot read; read it with nvCOMP {theirs.split('.')[0]}.x "
                                       "and `gdsckpt convert --codec zstd`", path=self.path)

    def _read(self, wanted, device, into: dict | None = None) -> dict:
        """Read tensors `wanted` (indices); new tensors on `device` (None: where they were saved
        from), or in place into `into[i]`."""
        t_start = time.perf_counter()
        plan = self.index.plan
        out: dict[int, torch.Tensor] = {}
        for i in wanted:
            t = plan.tensors[i]
            if into is not None:
                out[i] = into[i]
            else:
                dev = device if device is not None else self.index.devices[i]
                dev = torch.device(dev)
                if dev.type == "cuda" and not torch.cuda.is_available():
                    dev = torch.device("cpu")  # saved on a GPU, read where there is none
                out[i] = torch.empty(t.shape, dtype=BY_NAME[t.dtype], device=dev)
        needs_nvcomp = any(not rec.raw and plan.streams[c.stream].codec["name"] in codecs.NVCOMP_CODECS
                           for c, rec in zip(plan.chunks, self.index.records))
        kind = _choose_backend(needs_nvcomp or any(v.is_cuda for v in out.values()), self._backend_choice)
        # Decode into contiguous memory; a non-contiguous target gets a temporary, copied back at the end.
        work = {i: (v if v.is_contiguous() else torch.empty_like(v, memory_format=torch.contiguous_format))
                for i, v in out.items()}
        views = [None] * len(plan.tensors)
        for i, v in work.items():
            views[i] = v.reshape(-1).view(torch.uint8)
        wanted_set = set(work)
        chunk_ids = [c.index for c in plan.chunks if any(s.tensor in wanted_set for s in c.segments)]
        timings = Timings()
        with make_backend(kind, io=self._io, io_threads=self._io_threads) as be:
            if kind == "cpu":
                for ci in chunk_ids:
                    spec = plan.streams[plan.chunks[ci].stream].codec
                    if not self.index.records[ci].raw and not be.can_decode(spec):
                        raise codecs.no_cpu_decoder(spec, self.path)
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
            stored = sum(self.index.records[c].stored for c in chunk_ids)
            logical = sum(plan.chunks[c].length for c in chunk_ids)
            self.last_stats = Stats("load", str(self.path), be.name, be.io_path, logical, stored, stored,
                                    len(chunk_ids), max((plan.chunks[c].length for c in chunk_ids), default=0),
                                    self.ring_depth, time.perf_counter() - t_start, dict(timings.stages),
                                    timings.latencies, [], be.memory())
        return out

    def verify(self, deep: bool = False) -> dict:
        """Check every chunk's checksum on the CPU, reading chunk by chunk (no GPU needed).
        deep=True also decodes every chunk (on the GPU where a codec needs one) into fresh
        tensors. Raises ChecksumError / CheckpointFormatError naming the file, key and chunk."""
        fd = os.open(self._reopen_path(), os.O_RDONLY)
        try:
            self._same_file(fd)
            for c, rec in zip(self.index.plan.chunks, self.index.records):
                data = pread_exact(fd, rec.stored, rec.file_offset)
                key = self.index.plan.tensors[c.segments[0].tensor].key
                if len(data) != rec.stored:
                    raise CheckpointFormatError("chunk extends past the end of the file", path=self.path,
                                                key=key, chunk=c.index)
                if checksum(data) != rec.checksum:
                    raise ChecksumError("stored bytes do not match their checksum: the chunk is corrupt",
                                        path=self.path, key=key, chunk=c.index)
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


def _nvcomp_version() -> str | None:
    if not gpu_status()[0]:
        return None
    from .gpu.backend import nvcomp_version
    return nvcomp_version()


def open(path, **options) -> Checkpoint:  # noqa: A001 - mirrors safetensors.safe_open / builtins.open
    """Open a checkpoint lazily: keys(), info(key), get_tensor(key), load()."""
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
