"""Reading a checkpoint: `Checkpoint` (open, load, load_into, read, verify).

open:  source (gdsckpt/reading/sources.py: a local file or a store object) -> footer -> index (validated)
read:  ring (read, verify, decode into the tensors) -> tree; under trusted=False the chunks bound
       for an nvCOMP decoder are decoded by a child process instead (gdsckpt/reading/isolated.py)
"""

from __future__ import annotations

import os
import time

import torch

from gdsckpt import codecs
from gdsckpt.core import collector
from gdsckpt.format import file as fmt
from . import isolated as _isolated  # as a module: tests swap its run and needs_child
from . import sources
from gdsckpt.engine.backend import check_gds, check_io, choose, make_backend, nvcomp_version
from gdsckpt.format.checksum import ALGORITHMS
from gdsckpt.core.defaults import CPU_VERIFY_THREADS, READ_ONCE_GPU_FRACTION, RING_DEPTH
from gdsckpt.core.dtypes import BY_NAME, name_of
from gdsckpt.errors import CheckpointFormatError, GdsckptError, StateMismatchError, VersionError
from .restore import restore_into
from gdsckpt.engine.ring import (
    ReadsAhead, Timings, decode_verified, in_place, read_chunks, read_room, read_verified, verify_chunk,
)
from gdsckpt.stats import Stats, stream_stats
from gdsckpt.format.tree import span, unflatten


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


class Checkpoint:
    """A checkpoint opened for reading: the validated index, and tensors read on demand.

    Only the footer and index are read on open; `get_tensor` reads just the chunks
    that hold that tensor. `source` is where the bytes come from (gdsckpt/reading/sources.py: a local
    file, held open until close(), or an object in a store); `path` names it in errors and stats.
    read_all=True: the caller is to read every tensor (load, load_into), so a local file that will
    be read ahead into a GPU starts reading its records as soon as its index is read, beside the
    index's parse and the restore's plan.
    """

    def __init__(self, path, *, backend: str | None = None, io: str = "auto", ring_depth: int = RING_DEPTH,
                 io_threads: int | None = None, trusted: bool = True, read_all: bool = False):
        where = sources.locate(path)
        check_io(io, io_threads)
        if not isinstance(ring_depth, int) or isinstance(ring_depth, bool) or ring_depth < 1:
            raise ValueError(f"ring_depth must be a positive int, not {ring_depth!r}")
        choose(False, backend)  # a ValueError now for an unknown backend, not at the first read
        self.ring_depth = ring_depth
        # trusted=False: a file from elsewhere. No chunk reaches a GPU decoder in this process: a
        # child process decodes them (gdsckpt/reading/isolated.py).
        self.trusted = bool(trusted)
        # Where the bytes come from: a local file (held open until close) or a store object (ranged
        # GETs only); the footer and index are read now, each chunk record when a tensor needs it.
        self.source = sources.open_source(where, trusted=self.trusted)
        self.path = self.source.label
        # I/O path and workers: the caller's, else those that suit the source (a memory copy's), else the backend's.
        self._backend_choice, self._io = backend, self.source.io if io == "auto" else io
        self._io_threads = io_threads if io_threads is not None else self.source.io_threads
        # A whole restore of a local file: its reads start with the index's parse, not after the plan.
        whole = read_all and self.trusted and backend != "cpu" and isinstance(self.source, sources.LocalFile)
        try:
            self.index = fmt.read_index(self.source.pread, self.source.size, self.path,
                                        (lambda end: self.source.read_ahead(end, self._io)) if whole else None)
            self._check_nvcomp()
        except BaseException:
            self.source.close()
            raise
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
        return stream_stats(self.index.plan, self.index.records)

    # -- data
    def get_tensor(self, key: str, device=None) -> torch.Tensor:
        return self.read([key], device)[key]

    @collector.paused()
    def read(self, keys, device=None) -> dict[str, torch.Tensor]:
        """New tensors for `keys`, on `device` (None: where each was saved from), reading only
        the chunks that hold them. Keys of one stored tensor (aliases) get the same tensor."""
        dev = _device(device)
        keys = list(keys)
        wanted = [self._entry(k) for k in keys]
        out = {i: self._new_tensor(i, dev) for i in wanted}
        self._read(out)
        return {k: out[i] for k, i in zip(keys, wanted)}

    @collector.paused()
    def read_into(self, targets: dict, *, atomic: bool = False) -> Stats:
        """Decode `targets[key]` in place for each key (shape and dtype as in the checkpoint).

        Each stored tensor is decoded once: into its first target; a second target of it that is
        other memory gets a copy afterwards, and the same memory named twice (tied weights) is
        filled once. A target memory named by keys of two different stored tensors (tied here,
        stored apart, as a format 1.0 file of tied weights is) is filled from the first of them.

        A target must be a dense cpu or cuda tensor whose elements are distinct memory (not an
        expand()ed view), and overlap no other unless as the same view: else a StateMismatchError
        naming it, before anything is read. If the read,
        or a copy after it, fails part-way, the error says which targets were already overwritten
        (wholly or in part) and carries their keys as `.overwritten`; every other target is untouched.
        atomic=True first checks every chunk's checksum (and, on the CPU, its zstd frame headers),
        so that damage is found before the first byte reaches a target. Where the GPU has room for
        the stored bytes (defaults.READ_ONCE_GPU_FRACTION of its free memory) they are read once
        into it, checked there and decoded from there; else they are read twice (a checking pass,
        then the decoding one). A memory copy on the CPU is checked and decoded where it lies."""
        plan = self.index.plan
        primary: dict[int, torch.Tensor] = {}
        extra: dict[int, list[torch.Tensor]] = {}
        owner: dict[tuple, int] = {}  # target memory -> the stored tensor that fills it
        distinct: list[tuple[str, torch.Tensor]] = []  # the first key of each target memory
        for key, tgt in targets.items():
            i = self._entry(key)
            self._check_target(key, tgt, plan.tensors[i])
            mem = _memory(tgt)
            if mem in owner:
                continue  # filled already, by this stored tensor or (tied here, apart there) by another
            owner[mem] = i
            distinct.append((key, tgt))
            if i not in primary:
                primary[i] = tgt
            else:
                extra.setdefault(i, []).append(tgt)
        _refuse_overlaps(self.path, distinct)
        written: list[torch.Tensor] | None = None  # the targets written to, wholly or in part, by a failure
        try:
            self._read(primary, atomic=atomic)
            written = list(primary.values())  # all read; then the other targets of a stored tensor
            _copy([(t, t, primary[i]) for i, more in extra.items() for t in more], written)
        except BaseException as e:
            if written is None:  # the read stopped: it says which destinations it had written
                written = [primary[i] for i in getattr(e, "_gdsckpt_touched", ())]
            touched = set(map(_memory, written))
            _note_overwritten(e, [k for k, tgt in targets.items() if _memory(tgt) in touched])
            raise
        return self.last_stats

    def load(self, device=None):
        keys = [t.key for t in self.index.plan.tensors]
        tensors = self.read(keys, device)
        return unflatten(self.index.skeleton, [tensors[k] for k in keys])

    def load_into(self, state, *, strict: bool = True, atomic: bool = False) -> Stats:
        """Restore `state` from this checkpoint: tensors filled in place, objects' load_state_dict()
        called, plain values written back (restore.restore_into; `read_into` for aliases, failures
        and atomic)."""
        return restore_into(self, state, strict=strict, atomic=atomic)

    def _check_target(self, key: str, tgt, t) -> None:
        """read_into's target for stored tensor entry `t`, checked before anything is read: a
        dense cpu or cuda tensor of its dtype and shape, whose elements are distinct memory."""
        if not isinstance(tgt, torch.Tensor):
            raise StateMismatchError(f"{self.path}: the target of {key!r} is a {type(tgt).__name__}, not a tensor")
        if name_of(tgt.dtype) != t.dtype or tuple(tgt.shape) != t.shape:
            raise StateMismatchError(f"{self.path}: tensor {key!r} is {t.dtype}{list(t.shape)} in the "
                                     f"checkpoint but {name_of(tgt.dtype)}{list(tgt.shape)} in the target")
        if not (tgt.is_cpu or tgt.is_cuda) or tgt.layout != torch.strided:
            raise StateMismatchError(f"{self.path}: the target of {key!r} is not a dense cpu or cuda tensor")
        if _may_self_overlap(tgt):
            raise StateMismatchError(f"{self.path}: the target of {key!r} has elements that share memory (an "
                                     "expand()ed or stride-0 view, or an as_strided one): it cannot hold the "
                                     "saved tensor's values; load into a tensor of its own, e.g. .clone()")

    def _entry(self, key: str) -> int:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in {str(self.path)!r}") from None

    def _check_nvcomp(self):
        for s in self.index.plan.streams:
            if codecs.of(s.codec).nvcomp_native:
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
        written to, wholly or in part, when it stopped (read_into reports them by key), the copies
        back into non-contiguous destinations included."""
        t_start = time.perf_counter()
        plan, records = self.index.plan, self.index.records
        # Decode into contiguous memory; a non-contiguous target (or a conjugate or negative view,
        # whose bytes are not its values) gets a temporary, copied back at the end.
        work = {i: (v if _plain_memory(v) else torch.empty_like(v, memory_format=torch.contiguous_format))
                for i, v in out.items()}
        views = [None] * len(plan.tensors)
        for i, v in work.items():
            views[i] = v.reshape(-1).view(torch.uint8)
        chunk_ids = [c.index for c in plan.chunks if any(views[s.tensor] is not None for s in c.segments)]
        kind = self._backend_kind(out)
        check_gds(self._io, kind, "load")
        # trusted=False: the chunks bound for a decoder that can fault this process's CUDA context
        # are decoded by a child process, which hands back their bytes (gdsckpt/reading/isolated.py).
        child_ids = [] if self.trusted else [
            c for c in chunk_ids
            if _isolated.needs_child(kind, plan.streams[plan.chunks[c].stream].codec, records[c].raw)]
        in_child = set(child_ids)
        own_ids = [c for c in chunk_ids if c not in in_child]
        timings = Timings()
        reached: list[int] = []  # chunks whose bytes went to their tensors (ring.read_chunks, decode_verified)
        delivered: list[int] = []  # chunks the child decoded and handed over
        with make_backend(kind, io=self._io, io_threads=self._io_threads,
                          read_task_bytes=self.source.read_task_bytes) as be:
            # Asked once the backend is made: without a usable GPU, make_backend's BackendUnavailableError.
            device_index = _cuda_index() if kind == "gpu" else None
            self._check_decoders(be, chunk_ids)

            def scatter(c: int, data: torch.Tensor) -> None:  # a chunk the child decoded
                delivered.append(c)
                for s in plan.chunks[c].segments:
                    if views[s.tensor] is not None:
                        be.copy(views[s.tensor][s.tensor_offset:s.tensor_offset + s.length],
                                data[s.chunk_offset:s.chunk_offset + s.length])
                be.synchronize()  # the host slot goes back to the child after this

            file = self.source.open_chunks(be)
            try:
                be.begin()
                # Each stored byte read once where that costs nothing (a memory copy's mapping on the
                # CPU) or, atomic, where the device holds them all; else twice, atomic: a checking
                # pass before the decoding one.
                once = bool(own_ids) and (in_place(file) or (atomic and self._room_once(be, own_ids)))
                held = None
                if once:  # every chunk checked before the first byte reaches a target
                    held = read_verified(self.index, own_ids, be, file, timings, self.path,
                                         check=self._header_check if be.name == "cpu" else None,
                                         workers=_verify_threads(be))
                elif atomic:
                    t = time.perf_counter()
                    self._verify_twice(be, file, chunk_ids, own_ids, views)
                    timings.add("atomic_verify", t)
                if atomic and child_ids:  # and decoded once, into scratch, by a child
                    t = time.perf_counter()
                    _isolated.run(self._indexed_file(), child_ids, kind, device_index, self._io)
                    timings.add("atomic_verify", t)
                if once:
                    decode_verified(self.index, own_ids, held, views, be, timings, self.path, reached=reached)
                    held = None  # the stored bytes' buffer goes back now, not with the frame
                else:
                    read_chunks(self.index, own_ids, views, be, file, self.ring_depth, timings, self.path,
                                reached=reached)
                if child_ids:
                    t = time.perf_counter()
                    _isolated.run(self._indexed_file(), child_ids, kind, device_index, self._io, deliver=scatter)
                    timings.add("isolated_decode", t)
                be.finish()
            except BaseException as e:
                # A chunk's bytes reach its tensors only after its checksum passed (and, atomic, after
                # every chunk's had) or once the child handed them over: those chunks' tensors are
                # overwritten, the others untouched. Non-contiguous targets are written only by the
                # copy-back below.
                e._gdsckpt_touched = {s.tensor for c in reached + delivered for s in plan.chunks[c].segments
                                      if s.tensor in out and work[s.tensor] is out[s.tensor]}
                raise
            finally:
                io_path = be.io_path
                if isinstance(file, ReadsAhead):
                    io_path = file.io_path
                    timings.stages.update(file.stages)
                file.close()
            filled = [i for i, v in work.items() if v is out[i]]  # decoded in place: written
            try:
                _copy([(i, out[i], v) for i, v in work.items() if v is not out[i]], filled)
            except BaseException as e:
                e._gdsckpt_touched = set(filled)
                raise
            stored = sum(records[c].stored for c in chunk_ids)
            self.last_stats = Stats("load", str(self.path), be.name, io_path,
                                    sum(plan.chunks[c].length for c in chunk_ids), stored, stored, len(chunk_ids),
                                    max((plan.chunks[c].length for c in chunk_ids), default=0), self.ring_depth,
                                    time.perf_counter() - t_start, dict(timings.stages), timings.latencies, [],
                                    be.memory())

    def _backend_kind(self, out: dict) -> str:
        """The GPU where a chunk needs nvCOMP or a destination is on a GPU (unless told otherwise);
        the CPU where a chunk has only a CPU decoder (byte-shuffled zstd: it copies to the GPU)."""
        plan = self.index.plan
        needs_nvcomp = any(not rec.raw and not codecs.cpu_can_decode(plan.streams[c.stream].codec)
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
                raise codecs.of(spec).no_decoder(spec, self.path)

    def verify(self, deep: bool = False, isolated: bool = False) -> dict:
        """Check every chunk's checksum on the CPU, reading chunk by chunk (no GPU needed).
        deep=True also decodes every chunk (on the GPU where a codec needs one) into fresh
        tensors. isolated=True decodes every compressed chunk in a child process instead, and
        none in this one (`gdsckpt verify --isolated`: for files from elsewhere; implies deep).
        Raises ChecksumError / CheckpointFormatError naming the file, key and chunk."""
        self._verify_chunks(range(len(self.index.records)))
        if isolated:
            kind = self._backend_kind({})
            with make_backend(kind, io=self._io, io_threads=self._io_threads,
                              read_task_bytes=self.source.read_task_bytes) as be:
                self._check_decoders(be, range(len(self.index.records)))
            todo = [c for c, r in enumerate(self.index.records) if not r.raw]
            _isolated.run(self._indexed_file(), todo, kind, _cuda_index() if kind == "gpu" else None, self._io)
        elif deep:
            self.load(device="cpu" if all(self._cpu_decodable()) else None)
        return {"chunks": len(self.index.records), "tensors": len(self.index.plan.tensors),
                "stored_bytes": sum(r.stored for r in self.index.records), "deep": deep or isolated,
                "isolated": isolated}

    def check(self) -> None:
        """Every chunk's checksum (on the CPU its zstd frame headers too), read as a restore of
        this checkpoint reads it: on the GPU through its checksum kernel where its chunks need
        nvCOMP, a memory copy's mapping where it lies. Nothing decoded or written; a
        ChecksumError naming the chunk. For a restore in two steps at the read's rate, not one
        core's CRC rate (the memory tier's under torch.distributed: every rank checks its copy,
        all agree, then each loads)."""
        ids = list(range(len(self.index.records)))
        with make_backend(self._backend_kind({}), io=self._io, io_threads=self._io_threads,
                          read_task_bytes=self.source.read_task_bytes) as be:
            file = self.source.open_chunks(be)
            try:
                be.begin()
                if in_place(file):  # checked where they lie, by several threads
                    read_verified(self.index, ids, be, file, Timings(), self.path,
                                  check=self._header_check if be.name == "cpu" else None,
                                  workers=_verify_threads(be))
                else:
                    self._verify_twice(be, file, ids, ids, [None] * len(self.index.plan.tensors))
                be.finish()
            finally:
                file.close()

    def _room_once(self, be, chunk_ids) -> bool:
        """Whether an atomic read may hold every stored byte of `chunk_ids` in the backend's
        memory at once (ring.read_verified): on the GPU, within defaults.READ_ONCE_GPU_FRACTION of
        its free memory. The CPU backend reads twice instead (the page cache holds a file's
        bytes for the second read)."""
        if be.name != "gpu":
            return False
        return read_room(self.index, chunk_ids) <= READ_ONCE_GPU_FRACTION * torch.cuda.mem_get_info()[0]

    def _verify_twice(self, be, file, chunk_ids, own_ids, views) -> None:
        """atomic=True's checking pass where the stored bytes are read again to be decoded. On the
        GPU every chunk goes through the ring and the GPU's checksum kernel, nothing decoded (the
        CPU's pass ran at one core's CRC speed: 4.5 s for 4.1 GB of a memory-tier restore on an H100
        host, against ~0.1 s for the whole read); a child checks its own chunks (trusted=False). On
        the CPU every chunk, and its zstd frame headers, one chunk in memory at a time."""
        if be.name == "gpu":
            if own_ids:
                read_chunks(self.index, own_ids, views, be, file, self.ring_depth, Timings(), self.path,
                            verify_only=True)
        else:
            self._verify_chunks(chunk_ids, headers=True)

    def _header_check(self, ci: int, data: torch.Tensor) -> None:
        """atomic=True on the CPU: chunk ci's zstd frame headers too, the decoder's own first check,
        before any chunk is decoded."""
        c, rec = self.index.plan.chunks[ci], self.index.records[ci]
        if not rec.raw:
            _check_stored(data.numpy(), self.index.plan.streams[c.stream].codec, c, rec, self.path,
                          self.index.plan.tensors[c.segments[0].tensor].key)

    def _verify_chunks(self, chunk_ids, headers: bool = False) -> None:
        """Read `chunk_ids` on the CPU and check their checksums (headers=True: and their zstd frame
        headers, the decoder's own first check), one chunk in memory at a time."""
        plan, records = self.index.plan, self.index.records
        for ci in chunk_ids:
            c, rec = plan.chunks[ci], records[ci]
            key = plan.tensors[c.segments[0].tensor].key
            data = self.source.pread(rec.stored, rec.file_offset)
            verify_chunk(len(data), ALGORITHMS[self.index.checksum](data), rec, self.path, key, c.index)
            spec = plan.streams[c.stream].codec
            if headers and not rec.raw:
                _check_stored(data, spec, c, rec, self.path, key)

    def _indexed_file(self) -> _isolated.IndexedFile:
        return _isolated.IndexedFile(self.source, self.index)

    def _cpu_decodable(self):
        return (r.raw or codecs.cpu_can_decode(self.index.plan.streams[c.stream].codec)
                for c, r in zip(self.index.plan.chunks, self.index.records))

    def close(self):
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _memory(t: torch.Tensor) -> tuple:
    """Identifies a tensor's memory as a view: equal for the same memory seen the same way
    (model.state_dict() gives tied parameters as two detach()es of one; a conjugate or negative
    view is another way), by object if empty."""
    if not t.numel():
        return ("object", id(t))
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes are its values in order: contiguous, and no conjugate or negative view
    (whose values torch computes from the bytes as it reads them)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _copy(pairs, written: list) -> None:
    """dst.copy_(src) for each (tag, dst, src), outside autograd: a target may be an nn.Parameter,
    a leaf that requires grad, whose in-place copy autograd refuses. Each tag goes into `written`
    as its copy starts, so that a failure names the target it may have written in part."""
    with torch.no_grad():
        for tag, dst, src in pairs:
            written.append(tag)
            dst.copy_(src)


def _may_self_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may be one memory location (an expand()ed, stride-0 or
    as_strided view): a copy into it cannot keep each element's value. No where its strides,
    smallest first, each step past every element the smaller ones reach (a contiguous tensor, a
    transpose, a slice); conservative: a rare as_strided view that does not overlap is refused too."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    reach = 1  # elements from the first to the last one the dimensions so far reach, inclusive
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride < reach:
            return True
        reach += (size - 1) * stride
    return False


def _refuse_overlaps(path, named: list[tuple[str, torch.Tensor]]) -> None:
    """Targets of distinct memories whose byte ranges overlap (a tensor and its slice, transpose or
    conjugate, interleaved views): filled one after the other, a later one would overwrite part of
    an earlier one. A StateMismatchError naming both, as save refuses them (tree._refuse_overlaps):
    by byte range, so interleaved views that share no byte are refused too."""
    spans = sorted((t.get_device(), t.data_ptr(), t.data_ptr() + _bytes_spanned(t), key)
                   for key, t in named if t.numel())
    device, end, owner = None, 0, None
    for dev, start, stop, key in spans:
        if dev == device and start < end:
            raise StateMismatchError(f"{path}: the targets of {owner!r} and {key!r} share memory as different "
                                     "views (overlapping, not identical: e.g. a tensor and its transpose or a "
                                     "slice of it): filling one would change the other; load into tensors of "
                                     "their own, e.g. a .clone() of one of them")
        if dev != device or stop > end:
            device, end, owner = dev, stop, key


def _bytes_spanned(t: torch.Tensor) -> int:
    """Bytes from a non-empty tensor's first element to the end of its last."""
    return t.nbytes if t.is_contiguous() else span(t) * t.itemsize


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


def _check_stored(data: bytes, spec: dict, chunk, rec, path, key: str) -> None:
    """One chunk's stored bytes, checked as the decoders check them first (Codec.check_stored)."""
    try:
        codecs.of(spec).check_stored(memoryview(data), spec, chunk.length, rec.frames)
    except ValueError as e:
        raise CheckpointFormatError(f"chunk failed to decode ({e})", path=path, key=key, chunk=chunk.index) from None


def _cuda_index() -> int:
    return torch.cuda.current_device()


def _verify_threads(be) -> int:
    """Threads that check chunks side by side in ring.read_verified: on the CPU, where the
    checksum lets go of the GIL, up to defaults.CPU_VERIFY_THREADS; the GPU's kernel runs one
    chunk at a time on the pipeline's stream."""
    return max(1, min(CPU_VERIFY_THREADS, os.cpu_count() or 1)) if be.name == "cpu" else 1


# gdsckpt.open, load and load_into (gdsckpt/api.py) call these; their documentation is there.


def open(path, **options) -> Checkpoint:  # noqa: A001 - mirrors safetensors.safe_open / builtins.open
    return Checkpoint(path, **options)


def load(path, *, device=None, **options):
    with Checkpoint(path, read_all=True, **options) as ck:
        return ck.load(device)


def load_into(path, state, *, strict: bool = True, atomic: bool = False, **options) -> Stats:
    with Checkpoint(path, read_all=True, **options) as ck:
        return ck.load_into(state, strict=strict, atomic=atomic)
