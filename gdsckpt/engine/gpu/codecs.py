"""nvCOMP codecs on the pipeline's CUDA stream, writing into preallocated buffers.

ans and bitcomp use nvCOMP's native bitstream (one encode call per chunk, split by
nvCOMP into 64 KiB pieces that compress in parallel); ans-planes is ans over the chunk's
bytes byte-shuffled first (kernels.shuffle_bytes), unshuffled after decoding. zstd uses the RAW
bitstream, which is a standard zstd frame: a chunk is a batch of `frame_bytes` frames, packed
back to back, which CPU zstandard decodes byte-exact.
"""

from __future__ import annotations

import atexit
import gc
import weakref

import cupy
import numpy as np
from nvidia import nvcomp

from gdsckpt.codecs import ZSTD_HEADER_MAX, check_zstd_header, frame_bounds, frame_offsets
from gdsckpt.codecs import of as codec_of
from gdsckpt.errors import GdsckptError
from . import kernels

_ALIGN = 16  # nvCOMP's most restrictive buffer alignment
_UNVERIFIED_MAX = 4096  # sizes read from headers and not yet compared with nvCOMP's (a save has its chunks')


def nvcomp_version() -> str:
    return nvcomp.__version__


def _use_cupy_pools() -> None:
    """nvCOMP's default allocators call cudaMalloc / cudaHostAlloc for its scratch and batch
    tables on every call, about 1.7 ms each on the H100 host: more than compressing 256 MiB.
    CuPy's pools make them free after the first call. All our nvCOMP work is on one stream, so
    the pools' per-stream reuse is safe."""
    nvcomp.set_device_allocator(lambda nbytes, stream: cupy.cuda.alloc(nbytes))
    nvcomp.set_pinned_allocator(lambda nbytes, stream: cupy.cuda.alloc_pinned_memory(nbytes))


_use_cupy_pools()
_live: "weakref.WeakSet[NvcompCodecs]" = weakref.WeakSet()


@atexit.register
def _release() -> None:
    """Hand nvCOMP its own allocators back while Python is still alive: it holds our Python
    callables in static storage, and releasing them after interpreter teardown segfaulted every
    process at exit (seen on the H100 host, nvCOMP 6.0.0)."""
    for c in list(_live):
        c.release()
    gc.collect()
    nvcomp.set_device_allocator(None)
    nvcomp.set_pinned_allocator(None)


class NvcompCodecs:
    """nvCOMP codecs on `stream`.

    nvCOMP reads the compressed sizes back with a small device-to-host copy, which queues behind
    the device-to-host copies in flight on the copy engine (4 ms behind one 256 MiB chunk's,
    bench/results/2026-11-24-h100-idle/encode_wait.json) while its Python binding holds the GIL: a training thread beside
    an overlapped snapshot stood still that long per chunk (bench/results/2026-11-24-h100-idle/).
    So a native-bitstream chunk's size is read from its header by our own kernel (kernels.NativeSize,
    no copy engine), and nvCOMP's own sizes are compared with those once the save's copies are done
    (`verify_sizes`, before it commits); zstd's frame sizes, with no header, are read after waiting,
    without the GIL, for `copies`: the stream of this process's device-to-host copies on
    `device_id` (the snapshot's copy stream)."""

    def __init__(self, stream: cupy.cuda.Stream, device_id: int, copies: cupy.cuda.Stream | None = None):
        self.unverified: list = []  # (nvCOMP's result, the stored length read from its header)
        self._codecs: dict[tuple, nvcomp.Codec] = {}
        self._configs: dict[tuple, object] = {}
        self._stream = stream
        self._device = device_id
        self._copies = copies
        self._copied = cupy.cuda.Event(block=False, disable_timing=True)
        self._native_size = kernels.NativeSize(stream)
        self._bounds: dict[tuple, int] = {}
        _live.add(self)

    def release(self) -> None:
        """Let go of nvCOMP's objects (codecs, configs, results): before the stream they were made
        on, and before nvCOMP's allocators are handed back at exit (`_release`). A codec destroyed
        after its stream segfaults: tests/engine/test_gpu.py's header test, whose codecs own their
        stream, crashed in 7 of 12 runs before __del__ did this, 0 of 12 after (H100, 2026-11-24).
        The pipeline's codecs live as long as the process (gpu/backend.py)."""
        self.unverified.clear()
        self._codecs.clear()
        self._configs.clear()

    __del__ = release  # an instance's attributes go in the order set, the stream's before the codecs'

    def _codec(self, spec: dict, decode: bool = False) -> nvcomp.Codec:
        key = (spec["name"], spec.get("data_type"), spec.get("uncomp_chunk_size"))
        if decode:  # any codec of the algorithm and type decodes: the bitstream records the rest
            key = next((k for k in self._codecs if k[:2] == key[:2]), key)
        codec = self._codecs.get(key)
        if codec is None:
            kind = codec_of(spec)
            opts = {"algorithm": kind.nvcomp_algorithm, "device_id": self._device, "cuda_stream": self._stream.ptr}
            if kind.framed:  # frames: nvCOMP's RAW bitstream, one standard zstd frame each
                opts["bitstream_kind"] = nvcomp.BitstreamKind.RAW
            else:
                opts["data_type"] = spec["data_type"]
            if "uncomp_chunk_size" in spec:  # encode only: the native bitstream records it for decode
                opts["uncomp_chunk_size"] = spec["uncomp_chunk_size"]
            codec = self._codecs[key] = nvcomp.Codec(**opts)
        return codec

    def max_stored(self, spec: dict, nbytes: int) -> int:
        if codec_of(spec).nvcomp_algorithm is None:  # raw: stored as it is
            return nbytes
        if not codec_of(spec).framed:  # nvCOMP refuses an output buffer below its worst-case bound
            return max(nbytes, self._bound(spec, nbytes))
        frame = spec["frame_bytes"]  # zstd frames land at a fixed stride of nvCOMP's bound each
        return max(nbytes, self._bound(spec, min(frame, nbytes)) * len(frame_bounds(nbytes, frame)))

    def _bound(self, spec: dict, nbytes: int) -> int:
        """nvCOMP's worst-case compressed size, once per codec and size (a save asks per chunk).
        It asks for an array, not a size: an untouched host allocation of that size costs only
        address space."""
        key = (spec["name"], spec.get("data_type"), spec.get("uncomp_chunk_size"), nbytes)
        if key not in self._bounds:
            probe = np.empty(nbytes, dtype=np.uint8)
            self._bounds[key] = _round(self._codec(spec).get_max_comp_buffer_size(nvcomp.as_array(probe)))
        return self._bounds[key]

    def plane_width(self, spec: dict) -> int:
        """The width of the byte planes encode() codes `spec`'s chunks as (FORMAT.md's shuffle; 1: none)."""
        kind = codec_of(spec)
        return 1 if kind.nvcomp_algorithm is None or kind.framed else spec.get("shuffle", 1)

    def encode(self, spec: dict, src: cupy.ndarray, out: cupy.ndarray, scratch: cupy.ndarray,
               shuffled: bool = False):
        """(stored length, frames) with the stored bytes in `out`, or (-1, None) if it would not
        shrink, with `src` then holding the chunk's logical bytes. `scratch` may be overwritten (it
        may be `src` itself: src is consumed in stream order). shuffled: `src` holds the byte planes
        of plane_width(spec) already (gathered into them).

        Always the batched call: with caller-owned output buffers only a BatchArray reports the
        compressed sizes. ans/bitcomp: one entry (nvCOMP splits it internally); zstd: one per frame."""
        if codec_of(spec).nvcomp_algorithm is None:  # raw: stored as it is
            return -1, None
        codec, n, ptr = self._codec(spec), src.nbytes, self._stream.ptr
        if not codec_of(spec).framed:
            coded = src if shuffled else self._planes(spec, src, out, scratch)
            srcs = nvcomp.as_arrays(_typed(coded, spec), [0], [n], cuda_stream=ptr)
            outs = nvcomp.as_arrays(out, [0], [out.nbytes], cuda_stream=ptr)
            key = (spec["name"], spec.get("data_type"), n)
            if key not in self._configs:  # chunks share a few sizes: configure once per size
                self._configs[key] = codec.compression_config([n])
            result = codec.encode(srcs, out=outs, compression_config=self._configs[key])
            stored = self._stored(out, result)
            if stored < n:
                return stored, None
            if shuffled or (coded is not src and _overlap(src, coded)):  # src holds planes: give back its bytes to store raw
                kernels.unshuffle_bytes(self._stream, coded, out[:n], spec["shuffle"])
                src.data.copy_from_device_async(out.data, n, stream=self._stream)
            return -1, None
        bounds = frame_bounds(n, spec["frame_bytes"])
        stride = self._bound(spec, bounds[0][1])
        srcs = nvcomp.as_arrays(src, [o for o, _ in bounds], [k for _, k in bounds], cuda_stream=ptr)
        outs = nvcomp.as_arrays(out, [i * stride for i in range(len(bounds))], [stride] * len(bounds), cuda_stream=ptr)
        result = codec.encode(srcs, out=outs)
        self._wait()
        frames = list(result.buffer_sizes)
        offsets = frame_offsets(frames)
        stored = offsets[-1]
        if stored >= n:
            return -1, None
        # Pack the frames as FORMAT.md lays them out: through scratch, as a packed frame may
        # overlap a later frame's unpacked bytes.
        with self._stream:
            scratch[:stored].fill(0)
            for i, k in enumerate(frames):
                scratch[offsets[i]:offsets[i] + k] = out[i * stride:i * stride + k]
            out[:stored] = scratch[:stored]
        return stored, frames

    def _stored(self, out: cupy.ndarray, result) -> int:
        """A native-bitstream chunk's stored length, from its header (see the class docstring)."""
        stored = self._native_size(out)
        if stored is None:  # not the header this version of nvCOMP writes: nvCOMP's own read
            self._wait()
            return result.buffer_sizes[0]
        self.unverified.append((result, stored))
        if len(self.unverified) > _UNVERIFIED_MAX:  # encodes outside a save (a probe's): check as they come
            self.verify_sizes()
        return stored

    def verify_sizes(self) -> None:
        """nvCOMP's own size of every chunk read from its header since the last call, compared with
        that: a save calls it once its copies are done, before it commits (GpuBackend.finish)."""
        pending, self.unverified = self.unverified, []
        if pending:
            self._wait()
        for result, stored in pending:
            if result.buffer_sizes[0] != stored:
                raise GdsckptError(f"nvCOMP compressed a chunk to {result.buffer_sizes[0]} bytes, but its bitstream's "
                                   f"header gives {stored}: this nvCOMP ({nvcomp_version()}) lays its header out "
                                   "differently; nothing was saved")

    def _wait(self) -> None:
        """Wait without the GIL until reading nvCOMP's sizes is quick: for the stream's work
        (nvCOMP's own wait holds the GIL: bench/results/2026-11-23-h100-gil/) and the copies queued ahead of its sizes
        read, in one wait (each wait hands the GIL to the training thread beside a snapshot)."""
        if self._copies is not None:
            self._copied.record(self._copies)
            self._stream.wait_event(self._copied)
        self._stream.synchronize()

    def _planes(self, spec: dict, src: cupy.ndarray, out: cupy.ndarray, scratch: cupy.ndarray) -> cupy.ndarray:
        """What the coder reads: src itself, or for a spec with "shuffle", src's byte planes in
        scratch. Where src is the scratch (a gathered chunk), the planes go through `out`, free
        until the coder writes it, and are copied back: no buffer beyond the ring's."""
        width = spec.get("shuffle", 1)
        if width == 1:
            return src
        n = src.nbytes
        if scratch.nbytes < n or out.nbytes < n:
            raise ValueError(f"byte planes of {n} bytes need {n} bytes of scratch and output, "
                             f"got {scratch.nbytes} and {out.nbytes}")
        planes = scratch[:n]
        if _overlap(src, planes):
            kernels.shuffle_bytes(self._stream, src, out[:n], width)
            planes.data.copy_from_device_async(out.data, n, stream=self._stream)
        else:
            kernels.shuffle_bytes(self._stream, src, planes, width)
        return planes

    def decode_scratch(self, spec: dict, nbytes: int) -> int:
        """Device bytes decode() needs as scratch for a chunk of `nbytes`: byte planes decode there first."""
        return nbytes if spec.get("shuffle", 1) > 1 and not codec_of(spec).framed else 0

    def decode(self, spec: dict, stored: cupy.ndarray, out: cupy.ndarray, frames,
               scratch: cupy.ndarray | None = None) -> None:
        """`out` gets the chunk's logical bytes. `scratch`: decode_scratch(spec, out.nbytes) bytes,
        where that is not 0 (it may not overlap `out`)."""
        codec, ptr = self._codec(spec, decode=True), self._stream.ptr
        framed = codec_of(spec).framed
        width = 1 if framed else spec.get("shuffle", 1)
        if not framed:
            coded = out if width == 1 else scratch[:out.nbytes]
            srcs = nvcomp.as_arrays(stored, [0], [stored.nbytes], cuda_stream=ptr)
            outs = nvcomp.as_arrays(coded, [0], [out.nbytes], cuda_stream=ptr)
        else:
            bounds = frame_bounds(out.nbytes, spec["frame_bytes"])
            offsets = frame_offsets(frames)[:-1]
            _check_headers(stored, offsets, frames, [k for _, k in bounds], self._stream)
            srcs = nvcomp.as_arrays(stored, offsets, list(frames), cuda_stream=ptr)
            outs = nvcomp.as_arrays(out, [o for o, _ in bounds], [k for _, k in bounds], cuda_stream=ptr)
        result = codec.decode(srcs, out=outs)
        expected = [out.nbytes] if not framed else [k for _, k in bounds]
        if list(result.buffer_sizes) != expected:
            raise ValueError(f"decoded sizes {list(result.buffer_sizes)} differ from the expected {expected}")
        if width > 1:
            kernels.unshuffle_bytes(self._stream, coded, out, width)


def _check_headers(stored: cupy.ndarray, offsets, lengths, sizes, stream) -> None:
    """Read each frame's header back to the host and check it before nvCOMP, which trusts its input."""
    with stream:
        idx = (np.asarray(offsets)[:, None] + np.arange(ZSTD_HEADER_MAX)[None, :]).clip(0, stored.nbytes - 1)
        heads = stored[cupy.asarray(idx)].get()
    for head, clen, n in zip(heads, lengths, sizes):
        check_zstd_header(head[:min(clen, ZSTD_HEADER_MAX)], n)


def _overlap(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


def _typed(buf: cupy.ndarray, spec: dict) -> cupy.ndarray:
    """Typed ANS and Bitcomp read the symbol type from the array they are given."""
    return buf.view(cupy.dtype(spec["data_type"]))


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
