"""Public API: save, load, load_into, open.

save:   state -> tree -> save.save_flat (plan -> ring: gather, compress, write; format.FileWriter
        places records, then writes index and footer) -> fsync, rename
load:   footer -> index (validated) -> ring (read, verify, decode into the tensors) -> tree
"""

from __future__ import annotations

import os
import stat
import time
import weakref
from pathlib import Path

import torch

from . import codecs
from . import format as fmt
from . import isolated as _isolated
from . import remote as _remote
from .backend import choose, make_backend, nvcomp_version
from .checksum import ALGORITHMS
from .defaults import RING_DEPTH
from .dtypes import BY_NAME, name_of
from .errors import CheckpointFormatError, GdsckptError, StateMismatchError, VersionError
from .ring import ChunkFile, Timings, read_chunks, verify_chunk
from .save import IO_CHOICES, NewFile, SaveOptions, Sink, save_flat
from .save import check_gds as _check_gds  # the reader below shares the save's option checks
from .save import check_io as _check_io
from .save import is_int as _is_int
from .stats import Stats
from .stats import stream_stats as _stream_stats
from .storage import pread_exact, user_path
from .tree import flatten, placements, unflatten

__all__ = ["save", "save_through", "load", "load_into", "open", "Checkpoint", "Stats", "IO_CHOICES"]


def save(state, path, *, codec="auto", chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH,
         io: str = "auto", io_threads: int | None = None, backend: str | None = None) -> Stats:
    """Save `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

    Durable on return: the file is fsync'd and renamed over `path`, and the directory
    fsync'd; an existing checkpoint at `path` is replaced only by a complete one.
    codec: "auto" (typed ANS on the GPU, zstd on the CPU), "ans", "bitcomp", "zstd", "raw",
    or {dtype name: codec}. io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend).
    """
    started = time.perf_counter()
    destination = NewFile(user_path(path, "save"))  # a bad path: refused before anything else
    options = SaveOptions(codec=codec, chunk_bytes=chunk_bytes, ring_depth=ring_depth, io=io,
                          io_threads=io_threads, backend=backend)
    skeleton, leaves = flatten(state)
    return save_flat(skeleton, leaves, destination, options, started=started)


def save_through(state, sink: ChunkFile, **options) -> Stats:
    """The save pipeline into any ChunkFile, with `save`'s options: gdsckpt-bench's targets with
    storage removed (`sink.fd` None: records are placed but no header, index or footer written)."""
    started = time.perf_counter()
    options = SaveOptions(**options)
    skeleton, leaves = flatten(state)
    return save_flat(skeleton, leaves, Sink(sink), options, started=started)


def _device(device) -> torch.device | None:
    """A load's device= checked: None, "cpu", "cuda" or "cuda:N" that exists here; else ValueError."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device {device!r} is not a device ({e})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: gdsckpt loads onto 'cpu', 'cuda' or 'cuda:N' only")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this process has no CUDA device (torch.cuda.is_available() is "
                         "False); load with device='cpu', or device=None (each tensor where it was saved from, "
                         "the CPU where there is no GPU)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


# ---------------------------------------------------------------- reading


class Checkpoint:
    """A checkpoint opened for reading: the validated index, and tensors read on demand.

    Only the footer and index are read on open; `get_tensor` reads just the chunks
    that hold that tensor.
    """

    def __init__(self, path, *, backend: str | None = None, io: str = "auto", ring_depth: int = RING_DEPTH,
                 io_threads: int | None = None, trusted: bool = True):
        self._remote = None  # an s3:// checkpoint: remote.S3Source, read by ranged GETs only
        self.path = path if _remote.is_remote(path) else user_path(path, "open")
        _check_io(io, io_threads)
        if not _is_int(ring_depth) or ring_depth < 1:
            raise ValueError(f"ring_depth must be a positive int, not {ring_depth!r}")
        choose(False, backend)  # a ValueError now for an unknown backend, not at the first read
        self.ring_depth = ring_depth
        # trusted=False: a file from elsewhere. No chunk reaches a GPU decoder in this process: a
        # child process decodes them (gdsckpt/isolated.py).
        self.trusted = bool(trusted)
        if isinstance(self.path, str):
            self._open_remote(backend, io, io_threads)
            return
        # The file stays open: every later read goes to this file even if a save replaces the path.
        # O_NONBLOCK: a FIFO given by mistake must not hang the open.
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointFormatError("not a regular file, so not a checkpoint", path=self.path)
            self._identity = (st.st_dev, st.st_ino)
            self.index = fmt.read_index(lambda n, o: pread_exact(fd, n, o), st.st_size, self.path)
        except BaseException:
            self._closer()
            raise
        self._after_index(backend, io, io_threads)

    def _open_remote(self, backend, io, io_threads) -> None:
        """An object in an S3-compatible store: the footer and index by ranged GETs now, each chunk
        record by a ranged GET when a tensor that needs it is read (into device memory through
        KvikIO's RemoteFile on the GPU); nothing is downloaded whole."""
        if not self.trusted:
            raise ValueError("trusted=False reads local files only: download the object first")
        self._remote = _remote.S3Source(self.path)
        self._fd, self._identity = None, None
        self._closer = weakref.finalize(self, lambda: None)
        self.index = fmt.read_index(self._remote.pread, self._remote.size, self.path)
        self._after_index(backend, io, io_threads)

    def _after_index(self, backend, io, io_threads) -> None:
        self._check_nvcomp()
        self._backend_choice, self._io, self._io_threads = backend, io, io_threads
        # Every key path -> tensor: each stored tensor's key, then the keys of its aliases (tensors
        # saved as one because they shared memory, e.g. tied embeddings), which read and load_into
        # accept like any key.
        self._by_key = {t.key: i for i, t in enumerate(self.index.plan.tensors)}
        for key, i in self.index.paths.items():
            self._by_key.setdefault(key, i)
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
        the chunks that hold them. Keys of one stored tensor (aliases) get the same tensor."""
        dev = _device(device)
        keys = list(keys)
        wanted = [self._entry(k) for k in keys]
        out = {i: self._new_tensor(i, dev) for i in wanted}
        self._read(out)
        return {k: out[i] for k, i in zip(keys, wanted)}

    def read_into(self, targets: dict, *, atomic: bool = False) -> Stats:
        """Decode `targets[key]` in place for each key (shape and dtype as in the checkpoint).

        Each stored tensor is decoded once: into its first target; a second target of it that is
        other memory gets a copy afterwards, and the same memory named twice (tied weights) is
        filled once. A target memory named by keys of two different stored tensors (tied here,
        stored apart, as a format 1.0 file of tied weights is) is filled from the first of them.

        If the read fails part-way, the error says which targets were already overwritten (wholly
        or in part) and carries their keys as `.overwritten`; every other target is untouched.
        atomic=True first reads and checks every chunk's checksum (and zstd frame headers) on the
        CPU, so that damage is found before the first byte reaches a target: one more read of the
        stored bytes (see the README for its cost)."""
        plan = self.index.plan
        primary: dict[int, torch.Tensor] = {}
        extra: dict[int, list[torch.Tensor]] = {}
        owner: dict[tuple, int] = {}  # target memory -> the stored tensor that fills it
        for key, tgt in targets.items():
            i = self._entry(key)
            t = plan.tensors[i]
            if not isinstance(tgt, torch.Tensor):
                raise StateMismatchError(f"{self.path}: the target of {key!r} is a {type(tgt).__name__}, not a tensor")
            if name_of(tgt.dtype) != t.dtype or tuple(tgt.shape) != t.shape:
                raise StateMismatchError(f"{self.path}: tensor {key!r} is {t.dtype}{list(t.shape)} in the "
                                         f"checkpoint but {name_of(tgt.dtype)}{list(tgt.shape)} in the target")
            if not (tgt.is_cpu or tgt.is_cuda) or tgt.layout != torch.strided:
                raise StateMismatchError(f"{self.path}: the target of {key!r} is not a dense cpu or cuda tensor")
            mem = _memory(tgt)
            if mem in owner:
                continue  # filled already, by this stored tensor or (tied here, apart there) by another
            owner[mem] = i
            if i not in primary:
                primary[i] = tgt
            else:
                extra.setdefault(i, []).append(tgt)
        try:
            self._read(primary, atomic=atomic)
        except BaseException as e:
            touched = {_memory(primary[i]) for i in getattr(e, "_gdsckpt_touched", ())}
            _note_overwritten(e, [k for k, tgt in targets.items() if _memory(tgt) in touched])
            raise
        for i, more in extra.items():
            for tgt in more:
                tgt.copy_(primary[i])
        return self.last_stats

    def load(self, device=None):
        keys = [t.key for t in self.index.plan.tensors]
        tensors = self.read(keys, device)
        return unflatten(self.index.skeleton, [tensors[k] for k in keys])

    def load_into(self, state, *, strict: bool = True, atomic: bool = False) -> Stats:
        """Fill the tensors of `state` in place (see `read_into` for aliases, failures and atomic)."""
        skeleton, leaves = flatten(state)
        targets = {key: leaves[i].tensor for key, i in placements(skeleton)}
        missing = [k for k in self._by_key if k not in targets]
        extra = [k for k in targets if k not in self._by_key]
        if strict and (missing or extra):
            raise StateMismatchError(f"{self.path}: keys differ from the checkpoint's: missing from the target "
                                     f"{missing[:5]}, not in the checkpoint {extra[:5]}")
        return self.read_into({k: targets[k] for k in self._by_key if k in targets}, atomic=atomic)

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

    def _new_tensor(self, i: int, dev: torch.device | None) -> torch.Tensor:
        t = self.index.plan.tensors[i]
        if dev is None:
            dev = torch.device(self.index.devices[i])
            if dev.type == "cuda" and not torch.cuda.is_available():
                dev = torch.device("cpu")  # saved on a GPU, read where there is none (device=None only)
        return torch.empty(t.shape, dtype=BY_NAME[t.dtype], device=dev)

    def _read(self, out: dict[int, torch.Tensor], *, atomic: bool = False) -> None:
        """Fill `out[i]` (tensor i's destination) from the chunks that hold them.

        On failure the exception carries `_gdsckpt_touched`: the i whose destination the read had
        written to, wholly or in part, when it stopped (read_into reports them by key)."""
        t_start = time.perf_counter()
        plan, records = self.index.plan, self.index.records
        # Decode into contiguous memory; a non-contiguous target gets a temporary, copied back at the end.
        work = {i: (v if v.is_contiguous() else torch.empty_like(v, memory_format=torch.contiguous_format))
                for i, v in out.items()}
        views = [None] * len(plan.tensors)
        for i, v in work.items():
            views[i] = v.reshape(-1).view(torch.uint8)
        chunk_ids = [c.index for c in plan.chunks if any(views[s.tensor] is not None for s in c.segments)]
        kind = self._backend_kind(out)
        _check_gds(self._io, kind, "load")
        # trusted=False: the chunks bound for a decoder that can fault this process's CUDA context
        # are decoded by a child process, which hands back their bytes (gdsckpt/isolated.py).
        child_ids = [] if self.trusted else [
            c for c in chunk_ids
            if _isolated.needs_child(kind, plan.streams[plan.chunks[c].stream].codec, records[c].raw)]
        in_child = set(child_ids)
        own_ids = [c for c in chunk_ids if c not in in_child]
        timings = _Tracked(own_ids)
        delivered: list[int] = []
        with make_backend(kind, io=self._io, io_threads=self._io_threads) as be:
            self._check_decoders(be, chunk_ids)
            if atomic:  # every chunk checked before the first byte reaches a target
                self._verify_chunks(chunk_ids, headers=True)
                if child_ids:  # and decoded once, into scratch, by a child
                    _isolated.run(self, child_ids, kind, _cuda_index() if kind == "gpu" else None, self._io)
                timings.add("atomic_verify", t_start)

            def scatter(c: int, data: torch.Tensor) -> None:  # a chunk the child decoded
                delivered.append(c)
                for s in plan.chunks[c].segments:
                    if views[s.tensor] is not None:
                        be.copy(views[s.tensor][s.tensor_offset:s.tensor_offset + s.length],
                                data[s.chunk_offset:s.chunk_offset + s.length])
                be.synchronize()  # the host slot goes back to the child after this

            file = self._open_chunks(be)
            try:
                be.begin()
                read_chunks(self.index, own_ids, views, be, file, self.ring_depth, timings, self.path)
                if child_ids:
                    t = time.perf_counter()
                    _isolated.run(self, child_ids, kind, _cuda_index() if kind == "gpu" else None, self._io,
                                  deliver=scatter)
                    timings.add("isolated_decode", t)
                be.finish()
            except BaseException as e:
                # A chunk's bytes reach its tensors only after its checksum passed ("verify" stage)
                # or once the child handed them over: those chunks' tensors are overwritten, the
                # others untouched. Non-contiguous targets are written only by the copy-back below.
                e._gdsckpt_touched = {s.tensor for c in timings.verified + delivered for s in plan.chunks[c].segments
                                      if s.tensor in out and work[s.tensor] is out[s.tensor]}
                raise
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
        """The GPU where a chunk needs nvCOMP or a destination is on a GPU (unless told otherwise);
        the CPU where a chunk has only a CPU decoder (byte-shuffled zstd: it copies to the GPU)."""
        plan = self.index.plan
        needs_nvcomp = any(not rec.raw and plan.streams[c.stream].codec["name"] in codecs.NVCOMP_CODECS
                           for c, rec in zip(plan.chunks, self.index.records))
        cpu_only = any(not rec.raw and not codecs.gpu_can_decode(plan.streams[c.stream].codec)
                       for c, rec in zip(plan.chunks, self.index.records))
        wants_gpu = needs_nvcomp or (any(v.is_cuda for v in out.values()) and not cpu_only)
        return choose(wants_gpu, self._backend_choice)

    def _check_decoders(self, be, chunk_ids) -> None:
        """Before reading a byte: every chunk asked for has a decoder here."""
        plan = self.index.plan
        for ci in chunk_ids:
            spec = plan.streams[plan.chunks[ci].stream].codec
            if not self.index.records[ci].raw and not be.can_decode(spec):
                raise codecs.no_cpu_decoder(spec, self.path)

    def verify(self, deep: bool = False, isolated: bool = False) -> dict:
        """Check every chunk's checksum on the CPU, reading chunk by chunk (no GPU needed).
        deep=True also decodes every chunk (on the GPU where a codec needs one) into fresh
        tensors. isolated=True decodes every compressed chunk in a child process instead, and
        none in this one (`gdsckpt verify --isolated`: for files from elsewhere; implies deep).
        Raises ChecksumError / CheckpointFormatError naming the file, key and chunk."""
        self._verify_chunks(range(len(self.index.records)))
        if isolated:
            kind = self._backend_kind({})
            with make_backend(kind, io=self._io, io_threads=self._io_threads) as be:
                self._check_decoders(be, range(len(self.index.records)))
            todo = [c for c, r in enumerate(self.index.records) if not r.raw]
            _isolated.run(self, todo, kind, _cuda_index() if kind == "gpu" else None, self._io)
        elif deep:
            self.load(device="cpu" if all(self._cpu_decodable()) else None)
        return {"chunks": len(self.index.records), "tensors": len(self.index.plan.tensors),
                "stored_bytes": sum(r.stored for r in self.index.records), "deep": deep or isolated,
                "isolated": isolated}

    def _open_chunks(self, be):
        """The ring's ChunkFile on this checkpoint: the file opened, or the object's ranged GETs."""
        if self._remote is not None:
            return be.open_url(self.path, self._remote.size)
        file = be.open(self._reopen_path(), "r")
        try:
            self._same_file(file.fd)
        except BaseException:
            file.close()
            raise
        return file

    def _verify_chunks(self, chunk_ids, headers: bool = False) -> None:
        """Read `chunk_ids` on the CPU and check their checksums (headers=True: and their zstd frame
        headers, the decoder's own first check), one chunk in memory at a time."""
        plan, records = self.index.plan, self.index.records
        if self._remote is not None:
            fd, pread = None, self._remote.pread
        else:
            fd = os.open(self._reopen_path(), os.O_RDONLY)
            pread = lambda n, o: pread_exact(fd, n, o)  # noqa: E731
        try:
            if fd is not None:
                self._same_file(fd)
            for ci in chunk_ids:
                c, rec = plan.chunks[ci], records[ci]
                key = plan.tensors[c.segments[0].tensor].key
                data = pread(rec.stored, rec.file_offset)
                verify_chunk(len(data), ALGORITHMS[self.index.checksum](data), rec, self.path, key, c.index)
                spec = plan.streams[c.stream].codec
                if headers and spec["name"] == "zstd" and not rec.raw:
                    _check_frames(data, spec, c, rec, self.path, key)
        finally:
            if fd is not None:
                os.close(fd)

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


class _Tracked(Timings):
    """Timings that also record which chunks passed their checksum: read_chunks adds the
    "verify" stage for a chunk just before its bytes go to a decoder and its tensors."""

    def __init__(self, chunk_ids):
        super().__init__()
        self._ids, self.verified = chunk_ids, []

    def add(self, stage: str, t0: float) -> float:
        if stage == "verify":
            self.verified.append(self._ids[len(self.verified)])
        return super().add(stage, t0)


def _memory(t: torch.Tensor) -> tuple:
    """Identifies a tensor's memory as a view: equal for the same memory seen the same way
    (model.state_dict() gives tied parameters as two detach()es of one), by object if empty."""
    if not t.numel():
        return ("object", id(t))
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _note_overwritten(e: BaseException, keys: list[str]) -> None:
    """Say on a failed load_into / read_into which targets it had overwritten (wholly or in part)."""
    e.overwritten = keys
    shown = ", ".join(map(repr, keys[:10])) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
    note = (f"load_into had already overwritten {len(keys)} target tensor(s) when it failed: {shown} "
            "(all listed in the exception's .overwritten); the other targets are untouched"
            if keys else "load_into had not overwritten any target tensor when it failed")
    if isinstance(e, GdsckptError) and len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]}; {note}",)
    else:
        e.add_note(note)


def _check_frames(data: bytes, spec: dict, chunk, rec, path, key: str) -> None:
    """The zstd frame headers of one chunk's stored bytes, checked as the decoders check them."""
    view = memoryview(data)
    bounds = codecs.frame_bounds(chunk.length, spec["frame_bytes"])
    for (_, n), pos, clen in zip(bounds, codecs.frame_offsets(rec.frames), rec.frames):
        try:
            codecs.check_zstd_header(view[pos:pos + min(clen, codecs.ZSTD_HEADER_MAX)], n)
        except ValueError as e:
            raise CheckpointFormatError(f"chunk failed to decode ({e})", path=path, key=key, chunk=chunk.index) from None


def _cuda_index() -> int:
    return torch.cuda.current_device()


def open(path, **options) -> Checkpoint:  # noqa: A001 - mirrors safetensors.safe_open / builtins.open
    """Open a checkpoint lazily: keys(), info(key), get_tensor(key), read(keys), load().
    options: backend, io, ring_depth, io_threads, and trusted=False for a file you did not write
    (no chunk reaches a GPU decoder here before a child process has decoded it)."""
    return Checkpoint(path, **options)


def load(path, *, device=None, **options):
    """Load a checkpoint. device=None puts each tensor where it was saved from (cuda tensors on the
    current CUDA device; on the CPU where there is no GPU); "cpu" or "cuda:N" puts all there (a
    device that does not exist here is a ValueError). Tensors saved as one because they shared
    memory (tied weights) come back as one tensor in each of their places, as torch.save keeps
    them. trusted=False: see `open`."""
    return Checkpoint(path, **options).load(device)


def load_into(path, state, *, strict: bool = True, atomic: bool = False, **options) -> Stats:
    """Fill the tensors of `state` (e.g. model.state_dict()) in place from `path`: no second
    full-size allocation. A missing key, or a shape or dtype mismatch, is a StateMismatchError
    naming the key, raised before anything is read.

    If it fails part-way (a corrupt chunk, an I/O error), the error lists the keys it had already
    overwritten, wholly or in part (also as the exception's `.overwritten`); all other targets are
    untouched. atomic=True checks every chunk's checksum in one more read pass before the first
    byte reaches a target. A target tensor that several keys share (tied weights) is filled once.
    trusted=False: see `open`."""
    return Checkpoint(path, **options).load_into(state, strict=strict, atomic=atomic)
