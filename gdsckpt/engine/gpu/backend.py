"""The GPU backend: torch CUDA tensors viewed as CuPy arrays (no copies), nvCOMP on the
pipeline's own CUDA stream, KvikIO for chunk I/O."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import cupy
import numpy as np
import torch

from gdsckpt.codecs import gpu_can_decode
from gdsckpt.core.defaults import PIPELINE_STREAM_PRIORITY, SMALL_HOST_TENSOR
from gdsckpt.engine.device_copy import side_stream
from gdsckpt.engine.ring import ChecksumList
from . import kernels
from .codecs import NvcompCodecs, nvcomp_version
from .device_block import allocated
from .io import DeviceFile, io_settings

__all__ = ["GpuBackend"]


def as_cupy(t: torch.Tensor) -> cupy.ndarray:
    """A uint8 CuPy view of a CUDA tensor's bytes that keeps the tensor alive; no sync, no copy."""
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.nbytes, t, device_id=t.device.index)
    return cupy.ndarray((t.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))


class _DeviceResources:
    """What a save or restore on one GPU reuses: its stream, nvCOMP codecs (slow to create, and
    their configs), the checksum kernels. One pipeline at a time per GPU holds them."""

    def __init__(self, index: int):
        self.torch_stream = torch.cuda.Stream(index, priority=PIPELINE_STREAM_PRIORITY)
        self.stream = cupy.cuda.ExternalStream(self.torch_stream.cuda_stream, index)
        copies = side_stream("copy", torch.device("cuda", index))
        self.codecs = NvcompCodecs(self.stream, index, copies=cupy.cuda.ExternalStream(copies.cuda_stream, index))
        self._checksums: dict = {}
        self.gather_tables: _GatherTables | None = None  # the last save's, reused by the next of the same layout
        self.lock = threading.Lock()

    def checksummer(self, algorithm: str):
        """`algorithm`'s kernel on the stream, made on first use: a new process restoring a current
        file never builds format 1.0's (its compile cost a restore 0.03-0.1 s on the H100 host)."""
        kernel = self._checksums.get(algorithm)
        if kernel is None:
            kernel = self._checksums[algorithm] = kernels.ALGORITHMS[algorithm](self.stream)
        return kernel


@functools.cache
def _resources(index: int) -> _DeviceResources:
    return _DeviceResources(index)


class _GatherTables:
    """A plan's gather tiles on the device, for its tensors at the addresses `ptr` (those `here`,
    on this GPU; the `small_host` ones packed into `packed`): built with numpy and uploaded once,
    then reused while later saves find the same plan at the same addresses (`fits`). Building them
    cost an overlapped snapshot ~4 ms of Python per save, on a thread that shares the GIL with
    training (bench/results/2026-11-24-h100-priority/)."""

    def __init__(self, plan, ptr: np.ndarray, here: np.ndarray, small_host: list[int], tensors, device, stream):
        self._chunks, self._ptr, self._here = plan.chunks, ptr.copy(), here.copy()
        self._small = [(i, tensors[i].nbytes) for i in small_host]
        ptr = ptr.copy()
        self.packed = None  # device memory the tiles point into for the small host tensors
        if small_host:
            self.packed = torch.empty(sum(n for _, n in self._small), dtype=torch.uint8, device=device)
            ptr[small_host] = self.packed.data_ptr() + np.cumsum([0] + [n for _, n in self._small[:-1]])
        far = ~here
        far[small_host] = False  # what is left: large host tensors, tensors on another GPU
        # (tensor, offset in it, offset in the chunk, length, chunk) per segment
        seg = np.array([(s.tensor, s.tensor_offset, s.chunk_offset, s.length, c.index)
                        for c in plan.chunks for s in c.segments], dtype=np.int64).reshape(-1, 5)
        self.direct = [c.index for c in plan.chunks if len(c.segments) == 1 and here[c.segments[0].tensor]
                       and (ptr[c.segments[0].tensor] + c.segments[0].tensor_offset) % 16 == 0]
        gathered = ~far[seg[:, 0]] & ~np.isin(seg[:, 4], self.direct)
        rows = seg[gathered]
        tiles = kernels.gather_tiles(ptr[rows[:, 0]] + rows[:, 1], rows[:, 2], rows[:, 3])
        tile_chunk = np.repeat(rows[:, 4], -(-rows[:, 3] // kernels.GATHER_TILE))
        self.bounds = np.searchsorted(tile_chunk, np.arange(len(plan.chunks) + 1))
        with stream:
            self.tiles = cupy.asarray(tiles)
        self.far_segs: dict[int, list] = {}
        for t, toff, coff, n, c in seg[far[seg[:, 0]]].tolist():
            self.far_segs.setdefault(c, []).append((t, toff, coff, n))

    def fits(self, plan, ptr: np.ndarray, here: np.ndarray, small_host: list[int], tensors) -> bool:
        """True if these tables gather `plan` from tensors at `ptr`: the same plan (the save
        pipeline keeps plans by layout) and the same addresses."""
        return (plan.chunks is self._chunks and np.array_equal(ptr, self._ptr) and np.array_equal(here, self._here)
                and self._small == [(i, tensors[i].nbytes) for i in small_host])


class _QueuedCrc:
    """interfaces.Checksums by the CRC kernel: chunk i's launch writes word i of pinned host memory
    directly (the kernel reaches it by its host address), and values() waits once for the stream.
    A wait and a read-back per chunk left the copy engine idle while the checksum queued behind
    training kernels, and handed the GIL to the training thread of an overlapped snapshot
    (bench/results/2026-11-24-h100-priority/); a device array read back at the end would queue
    behind the last chunks' device-to-host copies."""

    def __init__(self, kernel: kernels.Crc64Nvme, stream: cupy.cuda.Stream, count: int):
        self._kernel, self._stream, self._n = kernel, stream, 0
        self._mem = cupy.cuda.alloc_pinned_memory(8 * max(count, 1))
        self._host = np.frombuffer(self._mem, dtype=np.uint64, count=max(count, 1))

    def add(self, buf: torch.Tensor) -> None:
        if buf.numel() == 0:
            self._host[self._n] = 0  # CRC-64/NVME of no bytes
        else:
            self._kernel.launch(as_cupy(buf), cupy.uint64(self._mem.ptr + 8 * self._n))
        self._n += 1

    def values(self) -> list[int]:
        self._stream.synchronize()
        return [int(v) for v in self._host[:self._n]]


class GpuBackend:
    name = "gpu"

    def __init__(self, io: str = "auto", io_threads: int | None = None, read_task_bytes: int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.io_path, self._settings = io_settings(io, io_threads, read_task_bytes)
        self.nvcomp_version = nvcomp_version()
        self._res = _resources(self.device.index)
        self._torch_stream, self._stream = self._res.torch_stream, self._res.stream
        self._codecs = self._res.codecs
        self._ring_bytes = 0
        self._free_at_start = 0
        self._min_free = 0
        self._encoded: set = set()  # (codec, bytes) encoded so far: the free memory is read after each one's first

    def __enter__(self):
        self._res.lock.acquire()
        self._caller_stream = torch.cuda.current_stream(self.device)  # before we switch streams
        self._settings.__enter__()
        self._stream_ctx = torch.cuda.stream(self._torch_stream)
        self._stream_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._torch_stream.synchronize()
        self._stream_ctx.__exit__(*exc)
        self._settings.__exit__(*exc)
        self._res.lock.release()
        return False

    def begin(self) -> None:
        """Order the pipeline after the caller's pending work on these tensors."""
        self._torch_stream.wait_stream(self._caller_stream)
        self._free_at_start = self._min_free = torch.cuda.mem_get_info(self.device)[0]
        self._codecs.unverified.clear()  # a failed save's

    def finish(self) -> None:
        self._torch_stream.synchronize()
        self._codecs.verify_sizes()

    def memory(self) -> dict:
        return {"ring_gpu_bytes": self._ring_bytes,
                "peak_extra_gpu_bytes": max(0, self._free_at_start - self._min_free),
                "pinned_host_bytes": 0}

    def can_decode(self, spec: dict) -> bool:
        return gpu_can_decode(spec)  # all but byte-shuffled zstd (CPU-only: FORMAT.md)

    def empty(self, nbytes: int, *, once: bool = False) -> torch.Tensor:
        self._ring_bytes += nbytes
        if once and nbytes:  # up to READ_ONCE_GPU_FRACTION of the free memory, for one call
            return allocated(nbytes, self.device)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def direct(self, view: torch.Tensor) -> bool:
        return view.device == self.device and view.data_ptr() % 16 == 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=dst.is_cuda and src.is_cuda)

    def scatter(self, copies) -> None:
        """One torch._foreach_copy_ for the pairs on this GPU (a chunk of small tensors holds
        dozens: a copy_ each cost ~30 us of Python, 0.2 s over a 6,300-tensor state), copy() for
        the others (a host tensor's bytes)."""
        dsts, srcs = [], []
        for dst, src in copies:
            if dst.device == self.device and src.device == self.device:
                dsts.append(dst)
                srcs.append(src)
            else:
                self.copy(dst, src)
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def gatherer(self, plan, views):
        """(chunk, staging, spec) -> what the spec's coder reads, on this GPU: a view of its tensor
        where the chunk lies inside one, else its segments gathered into `staging` by one kernel
        launch; for a byte-plane codec, gathered straight into their planes (shuffled True).

        The tile tables of every chunk are built with numpy and uploaded once per layout (kept for
        the next save of the same plan at the same addresses: a training loop's), so the ring's
        per-chunk work does not grow with the tensor count. Small host tensors (AdamW's `step`
        counters live on the CPU) are packed and uploaded together, into the same device buffer
        each save; large host tensors and tensors on another GPU are copied segment by segment."""
        tensors, dev = views.tensors, self.device.index
        ptr = np.zeros(len(tensors), dtype=np.int64)
        here = np.zeros(len(tensors), dtype=bool)  # on this GPU: compressible in place
        small_host = []
        for i, t in enumerate(tensors):
            if t.is_cuda and t.get_device() == dev:
                ptr[i] = t.data_ptr() if views.plain(i) else views[i].data_ptr()
                here[i] = True
            elif not t.is_cuda and t.nbytes <= SMALL_HOST_TENSOR:
                small_host.append(i)
        tables = self._res.gather_tables
        if tables is None or not tables.fits(plan, ptr, here, small_host, tensors):
            tables = self._res.gather_tables = _GatherTables(plan, ptr, here, small_host, tensors, self.device,
                                                             self._stream)
        if small_host:  # the packed copies' addresses are in the tables; their values are this save's
            tables.packed.copy_(torch.cat([views[i] for i in small_host]))
        direct: dict[int, torch.Tensor] = {}
        for c in tables.direct:  # inside one tensor here, at nvCOMP's alignment: compress from its memory
            s = plan.chunks[c].segments[0]
            direct[c] = views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
        dev_tiles, bounds, far_segs = tables.tiles, tables.bounds, tables.far_segs

        def gather(chunk, staging: torch.Tensor, spec: dict) -> tuple[torch.Tensor, bool]:
            if chunk.index in direct:
                return direct[chunk.index], False
            far = far_segs.get(chunk.index, ())  # copied in as they are: then the coder shuffles
            width = 1 if far else self._codecs.plane_width(spec)
            lo, hi = bounds[chunk.index], bounds[chunk.index + 1]
            kernels.gather(self._stream, dev_tiles[lo:hi], staging.data_ptr(), chunk.length, width)
            for t, toff, coff, n in far:
                self.copy(staging[coff:coff + n], views[t][toff:toff + n])
            return staging, width > 1
        return gather

    def max_stored(self, spec: dict, nbytes: int) -> int:
        return self._codecs.max_stored(spec, nbytes)

    def encode(self, spec, src, out, scratch, shuffled=False):
        result = self._codecs.encode(spec, as_cupy(src), as_cupy(out), as_cupy(scratch), shuffled)
        shape = (spec["name"], src.nbytes)
        if shape not in self._encoded:  # nvCOMP's scratch comes from pools: later chunks of a shape allocate nothing
            self._encoded.add(shape)
            self._min_free = min(self._min_free, torch.cuda.mem_get_info(self.device)[0])
        return result

    def decode(self, spec, stored, out, frames) -> None:
        # Byte planes decode into a scratch first: from torch's caching allocator, on the pipeline's
        # stream, so each chunk reuses the last one's block and torch may reuse it after the restore.
        need = self._codecs.decode_scratch(spec, out.nbytes)
        scratch = as_cupy(torch.empty(need, dtype=torch.uint8, device=self.device)) if need else None
        self._codecs.decode(spec, as_cupy(stored), as_cupy(out), frames, scratch)

    def checksum(self, buf: torch.Tensor, algorithm: str) -> int:
        return self._res.checksummer(algorithm)(as_cupy(buf))

    def checksums(self, algorithm: str, count: int):
        kernel = self._res.checksummer(algorithm)
        if isinstance(kernel, kernels.Crc64Nvme):
            return _QueuedCrc(kernel, self._stream, count)
        return ChecksumList(lambda buf: self.checksum(buf, algorithm))  # format 1.0's sum: read, never written

    def open(self, path: Path, mode: str) -> DeviceFile:
        return DeviceFile(path, mode, as_cupy, ready=self._torch_stream.synchronize)

    def synchronize(self) -> None:
        self._torch_stream.synchronize()
