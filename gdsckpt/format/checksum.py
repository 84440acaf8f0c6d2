"""Chunk checksums on the CPU, for numpy arrays, bytes and memoryviews (zero-copy where contiguous).

Two algorithms, one per format generation (the format module picks by version, via ALGORITHMS):

- ``crc64nvme``: CRC-64/NVME, the CRC of NVMe's end-to-end protection and S3's ``CRC64NVME``
  (width 64, poly 0xAD93D23594C93659, reflected in and out, init and xorout all ones,
  check("123456789") = 0xAE8B14860A799888). Computed here by ``awscrt`` (AWS's C runtime, with
  hardware carry-less-multiply paths: 25 GB/s on one core of our AMD EPYC dev machine, 256 MiB);
  the GPU computes the same value bit for bit (gdsckpt/engine/gpu/kernels.py, ``Crc64Nvme``).
- ``legacy_sum64``: format 1.0's position-weighted sum of 64-bit words mod 2^64. Kept only to read
  1.0 files: flipping the top bit of any two 8-byte words adds 2 * 2^63 = 2^64 = 0, so such damage
  passes it silently (issue 12, and tests/format/test_checksum.py shows it).

What CRC-64/NVME detects, exactly. A stored chunk of n bytes is m = 8n bits; a damaged copy of the
same length differs by an error pattern e(x) of degree < m, and is missed iff P(x) divides e(x)
(the init/xorout terms depend only on the length, so they cancel; a changed length is the index's
stored length's job, not the CRC's). P(x) is irreducible and
primitive: the multiplicative order of x modulo P is 2^64 - 1 (checked in tests/format/test_checksum.py
by factoring with sympy and testing x^((2^64-1)/q) != 1 for every prime q | 2^64 - 1). Hence:

- every error of 1 bit, and every error of 2 bits in any chunk of fewer than 2^64 - 1 bits (two
  flips d bits apart pass iff 2^64 - 1 divides d), i.e. in any chunk the format allows (2 GiB at
  most, format.MAX_CHUNK_BYTES);
- every error confined to a burst of at most 64 consecutive bits: such an e is x^i * B(x) with
  B(0) = 1 and deg B <= 63, and the irreducible P of degree 64 divides neither factor;
- every error of 3 bits whose first and last flipped bits are fewer than 3,279,135,667 bits apart,
  hence every 3-bit error in a chunk of at most 409,891,958 bytes (390.9 MiB), which includes
  every chunk at the default chunk size (256 MiB, stored raw or compressed). This follows from no general theorem (P(1) = 1: P is not
  a multiple of x + 1, so odd-weight errors are NOT all caught); an exhaustive search on the GPU
  made all 2^34 residues x^b mod P, b < 2^34, and found exactly 9 pairs with x^a + x^b = 1, the
  smallest b being 3,279,135,667 (a = 1,417,578,363): flipping bits 0, 1,861,557,304 and
  3,279,135,667 of a chunk of 409,891,959 bytes or more goes undetected (tests/format/test_checksum.py
  shows it). So chunks larger than 409,891,958 bytes (the format allows up to 2 GiB) lose the
  3-bit guarantee, and 3-bit errors spanning 2^34 bits or more were not searched
  (bench/probes/probe_checksum.py; bench/results/2026-11-23-h100-checksum/);
- nothing is guaranteed for errors of 4 or more bits (not searched) beyond the bursts above; a
  random error pattern passes with probability about 2^-64.

Why not CRC32C (also published, hardware-accelerated, and in nvCOMP's batched CRC32 API): its
polynomial is (x + 1) times a primitive factor of degree 31, so x has order 2^31 - 1 modulo it,
and two flipped bits exactly 2^31 - 1 apart cancel. A raw chunk is up to 256 MiB = 2^31 bits, so
the first bit and the last bit of a full raw chunk are such a pair (shown in the tests). Its
"every 2- and 3-bit error" guarantee ends just below our chunk size; CRC-64/NVME's does not.
xxHash64/XXH3 have no such guarantees at all (good avalanche, but no error-weight bound).
No CRC is a MAC: someone who can rewrite the file can rewrite the checksum too.
"""

from __future__ import annotations

import numpy as np
from awscrt import checksums as _awscrt

# ---------------------------------------------------------------------------------------------
# CRC-64/NVME


def _as_bytes(buf):
    """A zero-copy byte view of `buf` when it is contiguous (a copy only for strided arrays)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    return mv if mv.contiguous else mv.tobytes()


def crc64nvme(buf) -> int:
    """CRC-64/NVME of the bytes of `buf` (numpy array, bytes, bytearray, memoryview), as an int."""
    return _awscrt.crc64nvme(_as_bytes(buf))


# The polynomial arithmetic behind CRC-64/NVME, in the CRC's own reflected bit order: bit 63 of a
# 64-bit value is the coefficient of x^0, bit 0 that of x^63. The GPU kernel needs it to build its
# tables (the linear map "append n zero bytes" is a multiplication by x^(8n) mod P) and to combine
# partial CRCs; the tests use it to check the claims above.
POLY = 0xAD93D23594C93659                      # x^64 + ... as published (x^64 implicit)
POLY_REFLECTED = int(f"{POLY:064b}"[::-1], 2)  # 0x9A6C9329AC4BC9B5
ONE = 1 << 63                                  # the polynomial 1, reflected
MASK = (1 << 64) - 1


def gf_mul(a: int, b: int) -> int:
    """a * b mod P for reflected 64-bit values a, b."""
    p = 0
    m = ONE
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY_REFLECTED if b & 1 else b >> 1
    return p


_X2K = [ONE >> 1]  # x^(2^k) mod P, k = 0, 1, ...
for _ in range(127):
    _X2K.append(gf_mul(_X2K[-1], _X2K[-1]))


def gf_xpow(e: int) -> int:
    """x^e mod P (reflected); e may be negative (x is invertible: P(0) = 1; order 2^64 - 1)."""
    e %= MASK
    r, k = ONE, 0
    while e:
        if e & 1:
            r = gf_mul(r, _X2K[k])
        e >>= 1
        k += 1
    return r


def gf_mul_vec(a: int, b: np.ndarray) -> np.ndarray:
    """a * b[i] mod P for every element of the uint64 array b (vectorised over b): bit by bit for
    a few elements; for many, by byte tables of the map s -> s * a (8 lookups per element, ~20x
    fewer array passes: the GPU CRC's per-thread constants, 135k of them on an H100, are built
    with this in every new process)."""
    b = np.asarray(b, dtype=np.uint64)
    if b.size <= 1024:
        return _gf_mul_bits(a, b)
    t = linear_tables(mul_basis(a), 8)
    p = t[0][b & np.uint64(0xFF)]
    for j in range(1, 8):
        p ^= t[j][(b >> np.uint64(8 * j)) & np.uint64(0xFF)]
    return p


def _gf_mul_bits(a: int, b: np.ndarray) -> np.ndarray:
    b = b.astype(np.uint64, copy=True)
    p = np.zeros_like(b)
    poly, one = np.uint64(POLY_REFLECTED), np.uint64(1)
    for i in range(63, -1, -1):
        if a >> i & 1:
            p ^= b
        b = (b >> one) ^ (poly * (b & one))
    return p


def shift_tables(nbytes: int, bits: int = 8) -> np.ndarray:
    """(64 // bits, 2^bits) uint64 tables of the linear map s -> s * x^(8 * nbytes) mod P, `bits`
    bits of s at a time: with bits = 8 the map of s is T[0][s & 0xff] ^ T[1][(s >> 8) & 0xff] ^ ...
    ^ T[7][s >> 56]. nbytes = 8, bits = 8 gives the classic slice-by-8 tables."""
    return linear_tables(mul_basis(gf_xpow(8 * nbytes)), bits)


def linear_tables(basis: np.ndarray, bits: int) -> np.ndarray:
    """The tables of the GF(2)-linear map whose image of bit i is basis[i], `bits` bits at a time."""
    t = np.zeros((64 // bits, 1 << bits), dtype=np.uint64)
    idx = np.arange(1 << bits)
    for j in range(64 // bits):
        for bit in range(bits):
            t[j, (idx >> bit & 1) == 1] ^= basis[bits * j + bit]
    return t


def mul_basis(c: int) -> np.ndarray:
    """(64,) uint64: the image of each bit under s -> s * c mod P (so s * c = XOR of the entries
    at s's set bits): a multiplication by a constant as 64 independent loads."""
    return _gf_mul_bits(c, np.uint64(1) << np.arange(64, dtype=np.uint64))


def crc64nvme_of_zeros(n: int) -> int:
    """CRC-64/NVME of n zero bytes: the init's contribution (all ones times x^(8n)) plus xorout."""
    return gf_mul(MASK, gf_xpow(8 * n)) ^ MASK


# ---------------------------------------------------------------------------------------------
# Format 1.0's sum (read-only use)

GOLDEN = 0x9E3779B97F4A7C15
LENGTH_MIX = 0xC2B2AE3D27D4EB4F

_weights = np.zeros(0, dtype=np.uint64)


def _weights_for(n: int) -> np.ndarray:
    global _weights
    if len(_weights) < n:
        size = max(n, 2 * len(_weights))
        _weights = (np.arange(1, size + 1, dtype=np.uint64) * np.uint64(GOLDEN)) | np.uint64(1)
    return _weights[:n]


def legacy_sum64(buf) -> int:
    """Format 1.0's checksum: sum of w_i * ((i * GOLDEN) | 1) over little-endian 64-bit words,
    plus length * LENGTH_MIX, mod 2^64 (FORMAT.md). Misses pairs of flipped top bits; read-only."""
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    n = len(data)
    whole = n // 8
    total = int(np.dot(data[: whole * 8].view("<u8"), _weights_for(whole))) if whole else 0
    if n % 8:
        tail = int.from_bytes(bytes(data[whole * 8:]), "little")
        total += tail * (((whole + 1) * GOLDEN & MASK) | 1)
    return (total + n * LENGTH_MIX) & MASK


ALGORITHMS = {"sum64": legacy_sum64, "crc64nvme": crc64nvme}

# The algorithm new files are written with, and what `checksum` computes; the GPU side follows
# this same name (gdsckpt/engine/gpu/kernels.py: Checksummer). Files of format 1.0 are read with
# ALGORITHMS["sum64"]: the format's version says which algorithm a file uses (format.py).
CURRENT = "crc64nvme"
checksum = ALGORITHMS[CURRENT]
