"""The chunk checksum (FORMAT.md) on device memory, in one pass: the same value gdsckpt/checksum.py
computes on the CPU, so that chunks are verified on the GPU before any decoder sees them."""

from __future__ import annotations

import cupy

from ..checksum import LENGTH_MIX, MASK

_SOURCE = r"""
extern "C" __global__ void gdsckpt_checksum(const unsigned char* data, unsigned long long n,
                                            unsigned long long* out) {
    const unsigned long long G = 0x9E3779B97F4A7C15ULL;
    unsigned long long words = n >> 3, acc = 0;
    bool aligned = (((unsigned long long)data) & 7ULL) == 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long w = 0;
        if (aligned) {
            w = reinterpret_cast<const unsigned long long*>(data)[i];
        } else {
            for (int k = 0; k < 8; ++k) w |= (unsigned long long)data[i * 8 + k] << (8 * k);
        }
        acc += w * (((i + 1) * G) | 1ULL);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (n & 7ULL)) {
        unsigned long long w = 0;
        for (unsigned long long k = 0; k < (n & 7ULL); ++k) w |= (unsigned long long)data[words * 8 + k] << (8 * k);
        acc += w * (((words + 1) * G) | 1ULL);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
"""
_kernel = cupy.RawKernel(_SOURCE, "gdsckpt_checksum")

# Many small tensors into one chunk in one launch: a block per segment, the widest loads the
# segment's alignment allows. Large segments go to cudaMemcpy (gdsckpt/gpu/backend.py).
_GATHER = r"""
extern "C" __global__ void gdsckpt_gather(const unsigned long long* table, int n) {
    for (int seg = blockIdx.x; seg < n; seg += gridDim.x) {
        const unsigned char* src = (const unsigned char*)table[3 * seg];
        unsigned char* dst = (unsigned char*)table[3 * seg + 1];
        unsigned long long len = table[3 * seg + 2];
        unsigned long long align = ((unsigned long long)src | (unsigned long long)dst | len);
        if ((align & 15ULL) == 0) {
            for (unsigned long long i = threadIdx.x; i < len / 16; i += blockDim.x)
                ((uint4*)dst)[i] = ((const uint4*)src)[i];
        } else if ((align & 3ULL) == 0) {
            for (unsigned long long i = threadIdx.x; i < len / 4; i += blockDim.x)
                ((unsigned int*)dst)[i] = ((const unsigned int*)src)[i];
        } else {
            for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
        }
    }
}
"""
_gather_kernel = cupy.RawKernel(_GATHER, "gdsckpt_gather")


def gather(stream: cupy.cuda.Stream, table) -> None:
    """table: numpy uint64 array of (src pointer, dst pointer, length) triples."""
    n = len(table) // 3
    if n:
        with stream:
            dev = cupy.asarray(table)  # pool memory; the copy is ordered on `stream`
            _gather_kernel((min(n, 65535),), (256,), (dev, cupy.int32(n)))
_THREADS = 256


class Checksummer:
    """Checksums on one stream; the accumulator is preallocated and reused."""

    def __init__(self, stream: cupy.cuda.Stream):
        self._stream = stream
        with stream:
            self._acc = cupy.zeros(1, dtype=cupy.uint64)

    def __call__(self, buf: cupy.ndarray) -> int:
        n = buf.nbytes
        with self._stream:
            self._acc.fill(0)
            if n:
                blocks = max(1, min(4096, -(-n // (8 * _THREADS * 4))))
                _kernel((blocks,), (_THREADS,), (buf, cupy.uint64(n), self._acc))
            total = int(self._acc.get(stream=self._stream)[0])
        return (total + n * LENGTH_MIX) & MASK
