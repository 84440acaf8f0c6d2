"""The pipeline's own CUDA kernels: the chunk checksum (FORMAT.md) in one pass over device memory,
the same value gdsckpt/checksum.py computes on the CPU, so that chunks are verified on the GPU
before any decoder sees them; and the gather of a chunk's tensor segments in one launch."""

from __future__ import annotations

import cupy
import numpy as np

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

# A chunk's tensor segments in one launch, cut into tiles of at most GATHER_TILE bytes (one block
# per tile): launch count no longer grows with the tensor count, and big segments are spread over
# many SMs. Each tile copies with the widest word that its source and destination share the
# alignment of (bytes up to that alignment first): AdamW's 4-byte `step` tensors put most fp32
# segments 4 bytes off a 16-byte boundary, and a byte loop there ran at a fraction of HBM speed.
GATHER_TILE = 256 << 10
_GATHER = r"""
template <typename W>
__device__ void copy_words(const unsigned char* src, unsigned char* dst, long long len) {
    long long head = (long long)((sizeof(W) - ((unsigned long long)dst & (sizeof(W) - 1))) & (sizeof(W) - 1));
    if (head > len) head = len;
    for (long long i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    long long words = (len - head) / (long long)sizeof(W);
    const W* s = (const W*)(src + head);
    W* d = (W*)(dst + head);
    for (long long i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
    for (long long i = head + words * (long long)sizeof(W) + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void gdsckpt_gather(const long long* tiles, int n, unsigned char* base) {
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const unsigned char* src = (const unsigned char*)tiles[3 * t];
        unsigned char* dst = base + tiles[3 * t + 1];
        long long len = tiles[3 * t + 2];
        unsigned long long skew = (unsigned long long)src ^ (unsigned long long)dst;
        if ((skew & 15ULL) == 0) copy_words<uint4>(src, dst, len);
        else if ((skew & 7ULL) == 0) copy_words<uint2>(src, dst, len);
        else if ((skew & 3ULL) == 0) copy_words<unsigned int>(src, dst, len);
        else if ((skew & 1ULL) == 0) copy_words<unsigned short>(src, dst, len);
        else copy_words<unsigned char>(src, dst, len);
    }
}
"""
_gather_kernel = cupy.RawKernel(_GATHER, "gdsckpt_gather")


def gather_tiles(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Segments (source pointer, offset in the chunk, length) -> (n, 3) int64 tiles of at most GATHER_TILE."""
    count = -(-length // GATHER_TILE)
    seg = np.repeat(np.arange(len(length)), count)
    first = np.cumsum(count) - count
    at = (np.arange(len(seg)) - first[seg]) * GATHER_TILE
    return np.stack([src[seg] + at, dst[seg] + at, np.minimum(GATHER_TILE, length[seg] - at)], axis=1)


def gather(stream: cupy.cuda.Stream, tiles: cupy.ndarray, base: int) -> None:
    """Run the (n, 3) device tile table `tiles` into the chunk buffer at device address `base`."""
    n = len(tiles)
    if n:
        with stream:
            _gather_kernel((min(n, 1 << 16),), (256,), (tiles, cupy.int32(n), cupy.uint64(base)))


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
