"""The pipeline's own CUDA kernels: chunk checksums in one pass over device memory, equal bit for bit
to gdsckpt/format/checksum.py's CPU values, so that chunks are verified on the GPU before any decoder sees
them; the gather of a chunk's tensor segments in one launch; and the byte shuffle of byte-plane ANS."""

from __future__ import annotations

import functools

import cupy
import numpy as np

from gdsckpt.format.checksum import (
    CURRENT, LENGTH_MIX, MASK, crc64nvme_of_zeros, gf_mul_vec, gf_xpow, mul_basis, shift_tables,
)

# ---------------------------------------------------------------------------------------------
# CRC-64/NVME (gdsckpt/format/checksum.py says why this CRC, and what it detects).
#
# How: the buffer is read as aligned 8-byte words, W = grid x block threads of them per "row", and
# thread g owns word g of every row, so each warp reads 256 contiguous bytes per step (coalesced)
# and rows are read in order. The CRC is linear over GF(2): with zero init, the CRC of words
# w_0..w_{N-1} is the XOR of w_j * x^(64 (N - j)) mod P. Thread g keeps, by Horner's rule,
# s = s * x^(64 W) XOR w (one step = lookups in shared-memory tables of that linear map: 16 tables
# of 4 bits, copied 16 times so that no two lanes of a half-warp conflict, by default; or 8 byte
# tables, the classic slice-by-8 for the map x^64, which conflict at random), then multiplies s by
# x^(64 (W - g)) once (a 64-step carry-less multiply), and all contributions are XORed: within the
# warp by shuffles, within the block in shared memory, across blocks by the last block to finish
# (a ticket counter, reset by that block for the next call), so one launch per checksum.
# Arbitrary start and length: the word grid is aligned to 8 bytes in memory, bytes before the
# buffer and after its end read as zero (only the two edge words, by byte loads, so nothing
# outside the buffer is touched), and the grid is padded at the front with zero words to whole
# rows: leading zeros do not change a zero-init CRC. The k < 8 zero bytes after the end do (they
# multiply by x^(8k)), so the total is multiplied by x^(-8k) (a constant per k, 64 loads). The
# all-ones init is the same as XORing 0xFF into the first 8 bytes (for n >= 8; for n < 8 it is a
# constant per n), and xorout is a final XOR.
_CRC = r"""
typedef unsigned long long u64;
#define POLY_R 0x9A6C9329AC4BC9B5ULL

// a * b mod P, reflected (bit 63 = x^0)
__device__ __forceinline__ u64 gf_mul(u64 a, u64 b) {
    u64 p = 0;
    #pragma unroll 16
    for (int i = 63; i >= 0; --i) {
        p ^= b & (0ULL - ((a >> i) & 1ULL));
        b = (b >> 1) ^ (POLY_R & (0ULL - (b & 1ULL)));
    }
    return p;
}

// Word j of the aligned grid, byte by byte: bytes outside [lo, hi) are zero, the first 8 bytes of
// the buffer are XORed with 0xFF when init is set.
__device__ __noinline__ u64 edge_word(const unsigned char* base, long long j, u64 lo, u64 hi, int init) {
    u64 w = 0;
    for (int q = 0; q < 8; ++q) {
        u64 at = 8ULL * (u64)j + q;
        if (at >= lo && at < hi) {
            u64 b = base[at];
            if (init && at - lo < 8) b ^= 0xFFULL;
            w |= b << (8 * q);
        }
    }
    return w;
}

__device__ __forceinline__ u64 load_word(const unsigned char* base, long long j, long long words,
                                         u64 lo, u64 hi, int init) {
    if (j >= 2 && j <= words - 2) return __ldcs(reinterpret_cast<const u64*>(base) + j);
    return j >= 0 ? edge_word(base, j, lo, hi, init) : 0ULL;
}

#if NIBBLE
// 16 tables of 16 entries (4 bits of s each), 16 copies side by side: lane l reads copy l % 16, so
// the 16 lanes of a half-warp always hit 16 different bank pairs (byte tables are indexed at
// random and conflict), at twice the lookups per word.
#define LOOK(q) T[q][(s >> (4 * q)) & 15][copy]
#define STEP(s, w) s = (LOOK(0) ^ LOOK(1) ^ LOOK(2) ^ LOOK(3) ^ LOOK(4) ^ LOOK(5) ^ LOOK(6) ^ LOOK(7) ^ LOOK(8) \
                       ^ LOOK(9) ^ LOOK(10) ^ LOOK(11) ^ LOOK(12) ^ LOOK(13) ^ LOOK(14) ^ LOOK(15)) ^ (w)
#define TABLE_DECL __shared__ u64 T[16][16][16]
#define TABLE_FILL for (int i = threadIdx.x; i < 4096; i += THREADS) (&T[0][0][0])[i] = tables[i >> 4]
#else
#define STEP(s, w) s = (T[0][s & 255] ^ T[1][(s >> 8) & 255] ^ T[2][(s >> 16) & 255] ^ T[3][(s >> 24) & 255] \
                       ^ T[4][(s >> 32) & 255] ^ T[5][(s >> 40) & 255] ^ T[6][(s >> 48) & 255] ^ T[7][s >> 56]) ^ (w)
#define TABLE_DECL __shared__ u64 T[8][256]
#define TABLE_FILL for (int i = threadIdx.x; i < 2048; i += THREADS) T[i >> 8][i & 255] = tables[i]
#endif

extern "C" __global__ void __launch_bounds__(THREADS, BPSM)
gdsckpt_crc64nvme(const unsigned char* base, u64 lo, u64 hi, long long words, long long z, long long rows,
                  int init, const u64* __restrict__ tables, const u64* __restrict__ tail,
                  u64* partial, unsigned int* ticket, const u64* __restrict__ fin, u64 extra, u64* out) {
    TABLE_DECL;
    __shared__ u64 red[THREADS / 32];
    __shared__ int last;
    const int copy = threadIdx.x & 15;
    TABLE_FILL;
    __syncthreads();
    const long long W = (long long)gridDim.x * THREADS;
    const long long g = (long long)blockIdx.x * THREADS + threadIdx.x;
    long long j = g - z;  // this thread's word in row 0 (negative: front padding)
    u64 s = 0;
    long long r = 0;
    for (; r + UNROLL <= rows; r += UNROLL) {
        u64 w[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) w[u] = load_word(base, j + u * W, words, lo, hi, init);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) STEP(s, w[u]);
        j += UNROLL * W;
    }
    for (; r < rows; ++r, j += W) {
        u64 w = load_word(base, j, words, lo, hi, init);
        STEP(s, w);
    }
    u64 c = gf_mul(s, tail[g]);
    for (int off = 16; off > 0; off >>= 1) c ^= __shfl_xor_sync(0xffffffffu, c, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 b = 0;
        for (int i = 0; i < THREADS / 32; ++i) b ^= red[i];
        partial[blockIdx.x] = b;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    u64 v = 0;
    for (int i = threadIdx.x; i < gridDim.x; i += THREADS) v ^= ((volatile u64*)partial)[i];
    for (int off = 16; off > 0; off >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {  // times x^(-8k): lane l takes bits l and l + 32 (one load each, in parallel)
        u64 t = 0;
        for (int i = 0; i < THREADS / 32; ++i) t ^= red[i];
        const int l = threadIdx.x;
        u64 m = (fin[l] & (0ULL - ((t >> l) & 1ULL))) ^ (fin[l + 32] & (0ULL - ((t >> (l + 32)) & 1ULL)));
        for (int off = 16; off > 0; off >>= 1) m ^= __shfl_xor_sync(0xffffffffu, m, off);
        if (l == 0) {
            *out = m ^ extra;
            *ticket = 0;
        }
    }
}
"""

_crc_kernels: dict = {}


def _crc_kernel(threads: int, blocks_per_sm: int, unroll: int, nibble: bool) -> cupy.RawKernel:
    """The CRC kernel of one shape. Its parameters are #defines in the source, not -D options:
    CuPy preprocesses an empty file once per distinct option set to key its kernel cache (~20 ms
    of NVRTC in each new process), and the other kernels here use the default options."""
    key = (threads, blocks_per_sm, unroll, nibble)
    if key not in _crc_kernels:
        defines = "".join(f"#define {name} {value}\n" for name, value in
                          (("THREADS", threads), ("BPSM", blocks_per_sm), ("UNROLL", unroll), ("NIBBLE", int(nibble))))
        _crc_kernels[key] = cupy.RawKernel(defines + _CRC, "gdsckpt_crc64nvme")
    return _crc_kernels[key]


_ZEROS_CRC = tuple(crc64nvme_of_zeros(n) for n in range(8))


class Crc64Nvme:
    """CRC-64/NVME of device buffers on one stream, one launch per call; its tables, per-thread
    constants and scratch are made once here (about 1 MiB), nothing is allocated per call.
    Equal to gdsckpt.format.checksum.crc64nvme bit for bit (tests/engine/test_gpu_checksum.py)."""

    # The fastest of 13 shapes on the H100, 256 MiB (bench/results/2026-11-23-h100-checksum/): 4-bit
    # tables 1430-1579 GB/s against 1251-1283 GB/s for byte tables; 512 threads x 2 blocks per SM.
    THREADS, BLOCKS_PER_SM, UNROLL, NIBBLE = 512, 2, 4, True

    def __init__(self, stream: cupy.cuda.Stream, threads: int | None = None, blocks_per_sm: int | None = None,
                 unroll: int | None = None, nibble: bool | None = None):
        self._stream = stream
        threads = threads or self.THREADS
        bpsm = blocks_per_sm or self.BLOCKS_PER_SM
        nibble = self.NIBBLE if nibble is None else nibble
        self._kernel = _crc_kernel(threads, bpsm, unroll or self.UNROLL, nibble)
        self._threads = threads
        self._blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * bpsm
        w = self._blocks * threads
        self._w = w
        # x^(64 i) for i = 1..w, by doubling; thread g needs x^(64 (w - g)).
        powers = np.array([gf_xpow(64)], dtype=np.uint64)
        while len(powers) < w:
            powers = np.concatenate([powers, gf_mul_vec(gf_xpow(64 * len(powers)), powers)])
        tail = powers[:w][::-1].copy()
        fin = np.stack([mul_basis(gf_xpow(-8 * k)) for k in range(8)])  # undo k trailing zero bytes
        with stream:
            self._tables = cupy.asarray(shift_tables(8 * w, 4 if nibble else 8))
            self._tail = cupy.asarray(tail)
            self._fin = cupy.asarray(fin)
            self._partial = cupy.zeros(self._blocks, dtype=cupy.uint64)
            self._ticket = cupy.zeros(1, dtype=cupy.uint32)
            self._out = cupy.zeros(1, dtype=cupy.uint64)
        self._fin_rows = [self._fin[k] for k in range(8)]
        self._host = np.zeros(1, dtype=np.uint64)

    def launch(self, buf: cupy.ndarray, out=None):
        """Enqueue the CRC of `buf` (C-contiguous) on the stream into `out`, returned: a 1-element
        uint64 device array (default: this object's, overwritten by the next call), or, for n > 0,
        the address of a uint64 the GPU writes as a cupy.uint64 (pinned host memory). For n = 0 no
        kernel is launched."""
        out = self._out if out is None else out
        n = buf.nbytes
        if n == 0:
            with self._stream:
                out.fill(0)  # CRC-64/NVME of no bytes is 0 (init ^ xorout)
            return out
        if not buf.flags.c_contiguous:
            raise ValueError("Crc64Nvme needs a C-contiguous buffer")
        a = buf.data.ptr
        lo = a & 7
        words = (lo + n + 7) // 8
        rows = -(-words // self._w)
        z = rows * self._w - words
        k = (-(lo + n)) % 8
        extra = _ZEROS_CRC[n] if n < 8 else MASK
        with self._stream:
            self._kernel((self._blocks,), (self._threads,), (
                cupy.uint64(a - lo), cupy.uint64(lo), cupy.uint64(lo + n), cupy.int64(words), cupy.int64(z),
                cupy.int64(rows), cupy.int32(n >= 8), self._tables, self._tail, self._partial, self._ticket,
                self._fin_rows[k], cupy.uint64(extra), out))
        return out

    def __call__(self, buf: cupy.ndarray) -> int:
        self.launch(buf).get(stream=self._stream, out=self._host)
        self._stream.synchronize()  # get() with a stream may be asynchronous, depending on CuPy's version
        return int(self._host[0])


# ---------------------------------------------------------------------------------------------
# A chunk's stored length, from nvCOMP's native bitstream (ans, bitcomp): its header holds the
# magic number (u32 at byte 0), the compressed payload's length (u64 at byte 8) and the payload's
# offset (u32 at byte 40); the stored length is their sum (nvCOMP 6.0:
# bench/results/2026-11-24-h100-priority/nvcomp_header.json).
# One thread writes them into pinned host memory, which a kernel reaches by its host address (UVA),
# so the read uses no copy engine and never queues behind device-to-host copies.
NVCOMP_NATIVE_MAGIC = 1385239335
_NATIVE_SIZE = r"""
extern "C" __global__ void gdsckpt_native_size(const unsigned char* header, unsigned long long* out) {
    out[0] = *(const unsigned int*)header;
    out[1] = *(const unsigned long long*)(header + 8) + *(const unsigned int*)(header + 40);
}
"""
_native_size_kernel = cupy.RawKernel(_NATIVE_SIZE, "gdsckpt_native_size")


class NativeSize:
    """The stored length of a chunk nvCOMP encoded into its native bitstream, read on `stream`."""

    def __init__(self, stream: cupy.cuda.Stream):
        self._stream = stream
        self._mem = cupy.cuda.alloc_pinned_memory(16)
        self._host = np.frombuffer(self._mem, dtype=np.uint64, count=2)

    def __call__(self, out: cupy.ndarray) -> int | None:
        """The length of the bitstream at the start of `out` (8-byte aligned) once the stream's work
        has run, or None where it does not start with nvCOMP's native header."""
        self._host[:] = 0
        with self._stream:
            _native_size_kernel((1,), (1,), (out, cupy.uint64(self._mem.ptr)))
        self._stream.synchronize()
        return int(self._host[1]) if int(self._host[0]) == NVCOMP_NATIVE_MAGIC else None


# ---------------------------------------------------------------------------------------------
# Format 1.0's position-weighted sum (gdsckpt/format/checksum.py: legacy_sum64), kept to read 1.0 files.
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


class LegacySum64:
    """Format 1.0's sum on one stream; the accumulator is preallocated and reused."""

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


ALGORITHMS = {"sum64": LegacySum64, "crc64nvme": Crc64Nvme}
# The GPU side of gdsckpt.format.checksum.CURRENT: the pipeline's chunk checksum (gpu/backend.py).
Checksummer = ALGORITHMS[CURRENT]


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

# The gather and FORMAT.md's byte shuffle in one pass, for a chunk that byte-plane ANS codes: each
# tile's bytes go straight to their planes in the chunk buffer (byte b of element e at b*m + e,
# m = chunk length / w, the tail bytes after the planes), instead of a gather into the buffer, a
# shuffle into a second one and a copy back: three passes over the chunk in HBM, 12.7 of the
# 28.9 ms of GPU work in a snapshot of the bench's 4.9 GB AdamW state, 4.8 ms in one pass (H100,
# bench/results/2026-11-24-h100-fused/): the SM time an overlapped snapshot takes from training. A tile whose source, chunk offset and length are all
# multiples of w, inside the planes, moves whole elements; any other tile byte by byte.
_GATHER_PLANES = r"""
// K = 16 / W elements per thread and step, so that each plane gets K bytes from each thread: one
// K-byte store (P) where the plane's bytes are K-aligned, a warp filling 32 x K contiguous bytes of
// each plane. Elements before the first aligned one, and after the last whole group, one at a time.
template <typename E, typename P>
__device__ void gather_planes(const long long* tiles, int n, unsigned char* base, long long length) {
    const long long W = (long long)sizeof(E), K = 16 / W;
    const long long m = length / W, body = m * W;
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const unsigned char* src = (const unsigned char*)tiles[3 * t];
        const long long off = tiles[3 * t + 1], len = tiles[3 * t + 2];
        if ((unsigned long long)src % W == 0 && off % W == 0 && len % W == 0 && off + len <= body) {
            const E* s = (const E*)src;
            unsigned char* d = base + off / W;
            const long long ne = len / W;
            long long head = 0, groups = 0;
            if (m % K == 0) {  // then every plane starts at the alignment of the first
                head = (long long)((K - (unsigned long long)d % K) % K);
                if (head > ne) head = ne;
                groups = (ne - head) / K;
            }
            for (long long g = threadIdx.x; g < groups; g += blockDim.x) {
                const long long i0 = head + g * K;
                E e[16 / sizeof(E)];
                #pragma unroll
                for (int k = 0; k < (int)K; ++k) e[k] = s[i0 + k];
                #pragma unroll
                for (int b = 0; b < (int)W; ++b) {
                    P p = 0;
                    #pragma unroll
                    for (int k = 0; k < (int)K; ++k) p |= (P)((e[k] >> (8 * b)) & 0xFF) << (8 * k);
                    *(P*)(d + b * m + i0) = p;
                }
            }
            const long long tail = head + groups * K;
            for (long long i = threadIdx.x; i < head + (ne - tail); i += blockDim.x) {
                const long long j = i < head ? i : tail + (i - head);
                const E e = s[j];
                #pragma unroll
                for (int b = 0; b < (int)W; ++b) d[b * m + j] = (unsigned char)(e >> (8 * b));
            }
        } else {
            for (long long k = threadIdx.x; k < len; k += blockDim.x) {
                const long long o = off + k;
                base[o < body ? (o % W) * m + o / W : o] = src[k];
            }
        }
    }
}
extern "C" __global__ void gdsckpt_gather_planes_2(const long long* t, int n, unsigned char* b, long long len) {
    gather_planes<unsigned short, unsigned long long>(t, n, b, len);
}
extern "C" __global__ void gdsckpt_gather_planes_4(const long long* t, int n, unsigned char* b, long long len) {
    gather_planes<unsigned int, unsigned int>(t, n, b, len);
}
extern "C" __global__ void gdsckpt_gather_planes_8(const long long* t, int n, unsigned char* b, long long len) {
    gather_planes<unsigned long long, unsigned short>(t, n, b, len);
}
"""
_gather_planes_kernels = {w: cupy.RawKernel(_GATHER_PLANES, f"gdsckpt_gather_planes_{w}") for w in (2, 4, 8)}


def gather_tiles(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Segments (source pointer, offset in the chunk, length) -> (n, 3) int64 tiles of at most GATHER_TILE."""
    count = -(-length // GATHER_TILE)
    seg = np.repeat(np.arange(len(length)), count)
    first = np.cumsum(count) - count
    at = (np.arange(len(seg)) - first[seg]) * GATHER_TILE
    return np.stack([src[seg] + at, dst[seg] + at, np.minimum(GATHER_TILE, length[seg] - at)], axis=1)


def gather(stream: cupy.cuda.Stream, tiles: cupy.ndarray, base: int, length: int = 0, width: int = 1) -> None:
    """Run the (n, 3) device tile table `tiles` into the chunk buffer at device address `base`;
    with `width` 2, 4 or 8, into the byte planes of that width of the chunk's `length` bytes."""
    n = len(tiles)
    if n:
        with stream:
            if width == 1:
                _gather_kernel((min(n, 1 << 16),), (256,), (tiles, cupy.int32(n), cupy.uint64(base)))
            else:
                _gather_planes_kernels[width]((min(n, 1 << 16),), (256,),
                                              (tiles, cupy.int32(n), cupy.uint64(base), cupy.int64(length)))


# ---------------------------------------------------------------------------------------------
# FORMAT.md's byte shuffle ("shuffle": w), for byte-plane ANS (codecs/ans_planes.py): with n bytes
# and m = n / w elements, plane p (bytes p*m .. p*m + m - 1) holds byte p of every element in
# order, then the n - m*w tail bytes follow as they are: the layout codecs/zstd_cpu.shuffle_bytes
# writes on the CPU. One thread per element, grid-stride: a warp loads 32 consecutive elements
# (one w-byte word each, coalesced) and stores 32 consecutive bytes of each plane (a 32-byte
# sector per plane); the inverse reads those sectors and stores the words. Memory-bound, a pass
# over the chunk at HBM speed next to the entropy coder's 200-300 GB/s. An element not aligned to
# w in memory is moved byte by byte (`aligned` 0); the ring's buffers and direct views are 16-byte
# aligned, so that is only for other callers.
_PLANES = r"""
template <typename E>
__host__ __device__ __forceinline__ E get_elem(const unsigned char* p, long long i, int aligned) {
    if (aligned) return reinterpret_cast<const E*>(p)[i];
    E e = 0;
    for (int b = 0; b < (int)sizeof(E); ++b) e |= (E)((E)p[i * (long long)sizeof(E) + b] << (8 * b));
    return e;
}

template <typename E>
__host__ __device__ __forceinline__ void put_elem(unsigned char* p, long long i, E e, int aligned) {
    if (aligned) {
        reinterpret_cast<E*>(p)[i] = e;
        return;
    }
    for (int b = 0; b < (int)sizeof(E); ++b) p[i * (long long)sizeof(E) + b] = (unsigned char)(e >> (8 * b));
}

// Thread `first` of `step`: elements first, first + step, ... into their planes, then the tail bytes.
template <typename E>
__host__ __device__ void shuffle_part(const unsigned char* src, unsigned char* dst, long long n, int aligned,
                                      long long first, long long step) {
    const int W = (int)sizeof(E);
    const long long m = n / W;
    for (long long i = first; i < m; i += step) {
        const E e = get_elem<E>(src, i, aligned);
        #pragma unroll
        for (int b = 0; b < W; ++b) dst[b * m + i] = (unsigned char)(e >> (8 * b));
    }
    for (long long j = m * W + first; j < n; j += step) dst[j] = src[j];
}

template <typename E>
__host__ __device__ void unshuffle_part(const unsigned char* src, unsigned char* dst, long long n, int aligned,
                                        long long first, long long step) {
    const int W = (int)sizeof(E);
    const long long m = n / W;
    for (long long i = first; i < m; i += step) {
        E e = 0;
        #pragma unroll
        for (int b = 0; b < W; ++b) e |= (E)((E)src[b * m + i] << (8 * b));
        put_elem<E>(dst, i, e, aligned);
    }
    for (long long j = m * W + first; j < n; j += step) dst[j] = src[j];
}

#define GDSCKPT_PLANES(W, E)                                                                                   \
extern "C" __global__ void gdsckpt_shuffle_##W(const unsigned char* src, unsigned char* dst, long long n,     \
                                               int aligned) {                                                 \
    shuffle_part<E>(src, dst, n, aligned, (long long)blockIdx.x * blockDim.x + threadIdx.x,                   \
                    (long long)gridDim.x * blockDim.x);                                                       \
}                                                                                                              \
extern "C" __global__ void gdsckpt_unshuffle_##W(const unsigned char* src, unsigned char* dst, long long n,   \
                                                 int aligned) {                                               \
    unshuffle_part<E>(src, dst, n, aligned, (long long)blockIdx.x * blockDim.x + threadIdx.x,                 \
                      (long long)gridDim.x * blockDim.x);                                                     \
}
GDSCKPT_PLANES(2, unsigned short)
GDSCKPT_PLANES(4, unsigned int)
GDSCKPT_PLANES(8, unsigned long long)
"""
_PLANE_THREADS = 256
_PLANE_BLOCKS_PER_SM = 16  # enough resident warps to keep HBM busy; the grid-stride loop covers the rest


_plane_kernels = {(d, w): cupy.RawKernel(_PLANES, f"gdsckpt_{d}_{w}")  # compiled on first launch, once
                  for d in ("shuffle", "unshuffle") for w in (2, 4, 8)}


@functools.cache
def _plane_blocks_max(device: int) -> int:
    return cupy.cuda.Device(device).attributes["MultiProcessorCount"] * _PLANE_BLOCKS_PER_SM


def _planes(direction: str, stream: cupy.cuda.Stream, src: cupy.ndarray, dst: cupy.ndarray, width: int,
            aligned: bool) -> None:
    n = src.nbytes
    if width not in (2, 4, 8) or dst.nbytes != n or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError(f"byte {direction}: width {width}, {n} bytes into {dst.nbytes} (both contiguous)")
    if n == 0:
        return
    work = max(n // width, n % width)  # threads with something to do: one per element, or per tail byte
    blocks = min(-(-work // _PLANE_THREADS), _plane_blocks_max(cupy.cuda.Device().id))
    with stream:
        _plane_kernels[direction, width]((blocks,), (_PLANE_THREADS,), (src, dst, cupy.int64(n), cupy.int32(aligned)))


def shuffle_bytes(stream: cupy.cuda.Stream, src: cupy.ndarray, dst: cupy.ndarray, width: int) -> None:
    """Enqueue FORMAT.md's byte shuffle of `src` into `dst` (as many bytes, not overlapping) on `stream`."""
    _planes("shuffle", stream, src, dst, width, src.data.ptr % width == 0)


def unshuffle_bytes(stream: cupy.cuda.Stream, src: cupy.ndarray, dst: cupy.ndarray, width: int) -> None:
    """Enqueue the inverse of shuffle_bytes: `dst` gets the elements of the planes in `src` back."""
    _planes("unshuffle", stream, src, dst, width, dst.data.ptr % width == 0)
