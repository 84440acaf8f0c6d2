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
