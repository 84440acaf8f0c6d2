"""The chunk checksums on the CPU (gdsckpt/format/checksum.py): CRC-64/NVME from awscrt against the
published parameters, the error-detection properties its docstring claims, structured damage
that it must catch, and the format 1.0 sum's blind spot that made us replace it."""

import random

import numpy as np
import pytest
from awscrt import checksums as awscrt_checksums

from gdsckpt.format import checksum as ck
from gdsckpt.format.checksum import (
    ALGORITHMS, MASK, ONE, POLY, crc64nvme, crc64nvme_of_zeros, gf_mul, gf_mul_vec, gf_xpow, legacy_sum64,
    mul_basis, shift_tables,
)

CHECK = 0xAE8B14860A799888  # CRC-64/NVME("123456789"), from the CRC catalogue's parameter set


def reference_crc64nvme(data: bytes) -> int:
    """Bit at a time, straight from the published parameters (poly 0xAD93D23594C93659 reflected,
    init and xorout all ones): independent of awscrt and of gdsckpt's GF(2) helpers."""
    poly = int(f"{POLY:064b}"[::-1], 2)
    crc = MASK
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
    return crc ^ MASK


# --- the algorithm -------------------------------------------------------------------------------

def test_known_vectors():
    assert crc64nvme(b"123456789") == CHECK
    assert reference_crc64nvme(b"123456789") == CHECK
    assert crc64nvme(b"") == 0
    assert crc64nvme(bytes(8)) == reference_crc64nvme(bytes(8))
    assert crc64nvme(b"\xff" * 32) == reference_crc64nvme(b"\xff" * 32)


def test_agrees_with_reference_across_lengths_offsets_and_input_types():
    rng = np.random.default_rng(0)
    backing = rng.integers(0, 256, 200, dtype=np.uint8)
    for offset in range(8):
        for n in range(72):
            view = backing[offset:offset + n]
            want = reference_crc64nvme(view.tobytes())
            assert crc64nvme(view) == want, (offset, n)
            assert crc64nvme(view.tobytes()) == want
            assert crc64nvme(memoryview(view)) == want
            assert crc64nvme(bytearray(view.tobytes())) == want
    # wider dtypes and shapes checksum their bytes; strided arrays are made contiguous first
    a = rng.standard_normal((6, 10)).astype(np.float32)
    assert crc64nvme(a) == reference_crc64nvme(a.tobytes())
    assert crc64nvme(a[:, ::3]) == reference_crc64nvme(np.ascontiguousarray(a[:, ::3]).tobytes())
    assert crc64nvme(memoryview(a)) == reference_crc64nvme(a.tobytes())


def test_algorithm_table():
    assert ALGORITHMS == {"sum64": legacy_sum64, "crc64nvme": crc64nvme}
    assert ck.checksum is ALGORITHMS[ck.CURRENT]


# --- the polynomial arithmetic the GPU kernel is built from --------------------------------------

def test_gf_helpers_match_crc_combination():
    """crc(A + B) = crc(A) * x^(8 |B|) XOR crc(B): the identity the GPU kernel's combining rests on,
    checked against awscrt's own combine."""
    rng = random.Random(1)
    for la, lb in [(0, 0), (1, 0), (0, 5), (3, 9), (64, 1), (100, 37), (1000, 4096)]:
        a, b = rng.randbytes(la), rng.randbytes(lb)
        want = crc64nvme(a + b)
        assert gf_mul(crc64nvme(a), gf_xpow(8 * lb)) ^ crc64nvme(b) == want
        assert awscrt_checksums.combine_crc64nvme(crc64nvme(a), crc64nvme(b), lb) == want
    for n in range(20):
        assert crc64nvme_of_zeros(n) == crc64nvme(bytes(n))
    assert gf_mul(gf_xpow(8 * 7), gf_xpow(-8 * 7)) == ONE
    c = gf_xpow(12345)
    xs = np.array([rng.getrandbits(64) for _ in range(50)], dtype=np.uint64)
    assert [int(v) for v in gf_mul_vec(c, xs)] == [gf_mul(c, int(v)) for v in xs]
    basis = mul_basis(c)
    v = int(xs[0])
    assert gf_mul(v, c) == int(np.bitwise_xor.reduce(basis[[i for i in range(64) if v >> i & 1]]))


def test_shift_tables_are_slice_by_8():
    """Eight table lookups per 8-byte word reproduce the CRC (the GPU kernel's inner step)."""
    t = shift_tables(8)
    data = random.Random(2).randbytes(8 * 50)
    s = 0
    for i in range(0, len(data), 8):
        s ^= int.from_bytes(data[i:i + 8], "little")
        s = int(np.bitwise_xor.reduce([t[j][(s >> 8 * j) & 255] for j in range(8)]))
    assert s ^ crc64nvme_of_zeros(len(data)) == crc64nvme(data)
    # the 4-bit tables of the same map (the GPU kernel's other variant) agree with the byte tables
    t4 = shift_tables(8, bits=4)
    for v in (1, 0x8000000000000000, 0x0123456789ABCDEF, MASK):
        by4 = int(np.bitwise_xor.reduce([t4[q][(v >> 4 * q) & 15] for q in range(16)]))
        assert by4 == int(np.bitwise_xor.reduce([t[j][(v >> 8 * j) & 255] for j in range(8)])) == gf_mul(v, gf_xpow(64))


# --- the claims in gdsckpt/format/checksum.py's docstring ----------------------------------------------

def _poly_int(n: int) -> list[int]:
    return [1] + [(n >> (63 - i)) & 1 for i in range(64)]  # x^64 .. x^0


def test_crc64nvme_polynomial_is_primitive():
    """x has order exactly 2^64 - 1 modulo P: P is irreducible and primitive, so two flipped bits
    are caught at any distance below 2^64 - 1 bits. P(1) = 1: P is not a multiple of x + 1, so
    odd-weight errors are NOT all caught by a general rule (the 3-bit claim rests on the GPU
    search instead)."""
    sympy = pytest.importorskip("sympy")
    order = (1 << 64) - 1
    assert gf_xpow(order) == ONE
    for q in sympy.factorint(order):
        assert gf_xpow(order // q) != ONE, q
    assert sum(_poly_int(POLY)) % 2 == 1  # odd number of terms: P(1) = 1
    x = sympy.symbols("x")
    factors = sympy.Poly(_poly_int(POLY), x, modulus=2).factor_list()[1]
    assert [(f.degree(), e) for f, e in factors] == [(64, 1)]


def test_crc32c_polynomial_has_period_2_31_minus_1():
    """Why not CRC32C: its polynomial is (x + 1) times a degree-31 factor in which x has order
    2^31 - 1 (a prime), so x^(2^31 - 1) = 1 modulo the whole polynomial."""
    p = (1 << 32) | 0x1EDC6F41

    def mulmod(a, b):
        r = 0
        while b:
            if b & 1:
                r ^= a
            b >>= 1
            a <<= 1
            if a >> 32 & 1:
                a ^= p
        return r

    def xpow(e):
        r, base = 1, 2
        while e:
            if e & 1:
                r = mulmod(r, base)
            base = mulmod(base, base)
            e >>= 1
        return r

    assert xpow((1 << 31) - 1) == 1
    assert xpow(1 << 30) != 1


def test_two_flips_a_full_raw_chunk_apart():
    """The first and the last bit of a 256 MiB raw chunk (2^31 - 1 bits apart): CRC32C misses
    them, CRC-64/NVME does not. np.zeros maps the zero page, so this costs no real memory."""
    buf = np.zeros(1 << 28, dtype=np.uint8)
    clean32, clean64 = awscrt_checksums.crc32c(buf), crc64nvme(buf)
    buf[0] ^= 0x01      # bit 0 of the bit stream (reflected CRCs read bytes LSB first)
    buf[-1] ^= 0x80     # bit 2^31 - 1
    assert awscrt_checksums.crc32c(buf) == clean32
    assert crc64nvme(buf) != clean64
    buf[len(buf) // 3] ^= 0x10  # and a third flip in between
    assert crc64nvme(buf) != clean64


def test_three_flips_at_the_searched_limit():
    """The smallest trinomial multiple of P the GPU search found (probe_checksum.py): x^1417578363 +
    x^3279135667 + 1. Its three flips pass in a chunk one byte longer than the documented 3-bit
    limit (409,891,958 bytes), and moving any flip by one bit is caught: the docstring's limit is
    exact, and larger chunks do not have the 3-bit guarantee."""
    a, b = 1417578363, 3279135667
    assert gf_xpow(a) ^ gf_xpow(b) == ONE
    buf = np.zeros(b // 8 + 1, dtype=np.uint8)  # 409,891,959 bytes of zero pages: no real memory
    assert len(buf) == 409_891_958 + 1
    clean = crc64nvme(buf)
    flips = [0, b - a, b]  # bit i of the stream is bit i % 8 of byte i // 8 (reflected CRC)
    for i in flips:
        buf[i >> 3] ^= np.uint8(1 << (i & 7))
    assert crc64nvme(buf) == clean  # undetected: the limit is real
    buf[b >> 3] ^= np.uint8(1 << (b & 7))
    buf[(b - 1) >> 3] ^= np.uint8(1 << ((b - 1) & 7))
    assert crc64nvme(buf) != clean


# --- structured damage on a 1 MiB chunk ----------------------------------------------------------

N = 1 << 20


@pytest.fixture(scope="module")
def chunk():
    return np.random.default_rng(12).integers(0, 256, N, dtype=np.uint8)


def _detected(buf, clean, flips) -> bool:
    """Flip the given bit positions (bit i = byte i // 8, bit i % 8), checksum, restore."""
    for i in flips:
        buf[i >> 3] ^= np.uint8(1 << (i & 7))
    changed = crc64nvme(buf) != clean
    for i in flips:
        buf[i >> 3] ^= np.uint8(1 << (i & 7))
    return changed


def test_pairs_of_flipped_bits(chunk):
    buf, clean, rng = chunk.copy(), crc64nvme(chunk), random.Random(3)
    top = lambda word: 64 * word + 63  # noqa: E731: the top bit of 8-byte word `word`
    words = N // 8
    cases = [(top(0), top(1)), (top(0), top(words - 1)), (0, 8 * N - 1)]
    cases += [(top(a), top(b)) for a, b in (sorted(rng.sample(range(words), 2)) for _ in range(1500))]
    cases += [tuple(rng.sample(range(8 * N), 2)) for _ in range(1500)]
    cases += [(i, i + d) for i in (0, 12345) for d in (1, 63, 64, 65, 4096 * 8)]
    for flips in cases:
        assert _detected(buf, clean, flips), flips
    assert np.array_equal(buf, chunk)


def test_triples_of_flipped_bits(chunk):
    buf, clean, rng = chunk.copy(), crc64nvme(chunk), random.Random(4)
    words = N // 8
    cases = [tuple(64 * w + 63 for w in rng.sample(range(words), 3)) for _ in range(1500)]
    cases += [tuple(rng.sample(range(8 * N), 3)) for _ in range(1500)]
    cases += [(0, 8 * N // 2, 8 * N - 1), (63, 127, 191)]
    for flips in cases:
        assert _detected(buf, clean, flips), flips


def test_bursts_up_to_64_bits(chunk):
    """Every burst length 1..64 (first and last bit flipped, random bits between), at word-aligned,
    unaligned and end-of-chunk positions."""
    buf, clean, rng = chunk.copy(), crc64nvme(chunk), random.Random(5)
    for length in range(1, 65):
        for start in (0, 61, 8 * N - length, *(rng.randrange(8 * N - length) for _ in range(20))):
            inner = [start + i for i in range(1, length - 1) if rng.random() < 0.5]
            flips = sorted({start, start + length - 1, *inner})
            assert _detected(buf, clean, flips), (length, start)


def test_swapped_8_byte_words(chunk):
    buf, clean, rng = chunk.copy(), crc64nvme(chunk), random.Random(6)
    words = buf.view("<u8")
    pairs = [(0, 1), (0, len(words) - 1)] + [tuple(rng.sample(range(len(words)), 2)) for _ in range(1000)]
    for a, b in pairs:
        if words[a] == words[b]:
            continue  # swapping equal words changes nothing
        words[[a, b]] = words[[b, a]]
        assert crc64nvme(buf) != clean, (a, b)
        words[[a, b]] = words[[b, a]]
    assert np.array_equal(buf, chunk)


def test_legacy_sum_misses_two_flipped_top_bits(chunk):
    """Why format 1.0's sum was replaced: flipping bit 63 of two 8-byte words adds
    2^63 * (odd + odd) = 0 mod 2^64. CRC-64/NVME catches the same damage."""
    buf = chunk.copy()
    legacy, crc = legacy_sum64(buf), crc64nvme(buf)
    buf[7] ^= 0x80
    buf[15] ^= 0x80
    assert legacy_sum64(buf) == legacy   # silent
    assert crc64nvme(buf) != crc
    # still format 1.0's value (computed by the 1.0 code): 1.0 files keep verifying
    assert legacy_sum64(b"123456789") == 0xAA4B7782FB54615F
