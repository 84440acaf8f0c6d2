"""The GPU checksums (gdsckpt/engine/gpu/kernels.py) equal the CPU library's values bit for bit: every
length class the kernel's edge handling distinguishes, misaligned starts, an all-ones buffer, a
full 256 MiB raw chunk, and buffers that are views into a larger allocation."""

import numpy as np
import pytest

from gdsckpt.format.checksum import crc64nvme, legacy_sum64

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 63, 64, 65, 4095, 4096, 1 << 20, (4 << 20) + 3]


@pytest.fixture(scope="module")
def gpu():
    cupy = pytest.importorskip("cupy")
    from gdsckpt.engine.gpu.kernels import Checksummer, Crc64Nvme, LegacySum64
    stream = cupy.cuda.Stream(non_blocking=True)
    return cupy, stream, Crc64Nvme(stream), LegacySum64(stream), Checksummer


@pytest.fixture(scope="module")
def data(gpu):
    cupy = gpu[0]
    host = np.random.default_rng(7).integers(0, 256, (4 << 20) + 64, dtype=np.uint8)
    return host, cupy.asarray(host)


def test_lengths_and_misaligned_starts(gpu, data):
    _, _, crc, _, _ = gpu
    host, dev = data
    for n in LENGTHS:
        for start in (0, 1, 3, 7, 8, 13):
            assert crc(dev[start:start + n]) == crc64nvme(host[start:start + n]), (n, start)


def test_every_small_length_and_offset(gpu, data):
    _, _, crc, _, _ = gpu
    host, dev = data
    for start in range(16):
        for n in range(0, 200):
            assert crc(dev[start:start + n]) == crc64nvme(host[start:start + n]), (n, start)


def test_all_ones_and_zeros(gpu):
    cupy, _, crc, _, _ = gpu
    for n in (1, 8, 100, 1 << 20, (1 << 20) + 5):
        assert crc(cupy.full(n, 0xFF, dtype=cupy.uint8)) == crc64nvme(b"\xff" * n), n
        assert crc(cupy.zeros(n, dtype=cupy.uint8)) == crc64nvme(bytes(n)), n


def test_typed_buffers(gpu):
    """A float32 or int64 array checksums its bytes, like the CPU path."""
    cupy, _, crc, _, _ = gpu
    a = cupy.arange(100_003, dtype=cupy.float32)
    assert crc(a) == crc64nvme(cupy.asnumpy(a))
    b = cupy.arange(777, dtype=cupy.int64)
    assert crc(b) == crc64nvme(cupy.asnumpy(b))


def test_full_raw_chunk_256_mib_and_damage(gpu):
    """A 256 MiB chunk (the largest raw chunk), then the two flips 2^31 - 1 bits apart that
    CRC32C would miss, and two flipped top bits of 8-byte words that the old sum missed."""
    cupy, _, crc, _, _ = gpu
    n = 256 << 20
    host = np.frombuffer(np.random.default_rng(3).bytes(n), dtype=np.uint8).copy()
    dev = cupy.asarray(host)
    clean = crc64nvme(host)
    assert crc(dev) == clean
    dev[0] ^= 1
    dev[n - 1] ^= 0x80
    host[0] ^= 1
    host[n - 1] ^= 0x80
    assert crc(dev) == crc64nvme(host) != clean
    dev[0] ^= 1
    dev[n - 1] ^= 0x80
    dev[7] ^= 0x80
    dev[n // 2 + 7] ^= 0x80
    assert crc(dev) != clean
    assert crc(dev[5:n - 2]) == crc64nvme(cupy.asnumpy(dev[5:n - 2]))


def test_repeated_calls_and_two_instances(gpu, data):
    """The ticket counter resets itself: the same value on every call, and instances do not interfere."""
    cupy, stream, crc, _, _ = gpu
    from gdsckpt.engine.gpu.kernels import Crc64Nvme
    host, dev = data
    other = Crc64Nvme(cupy.cuda.Stream(non_blocking=True))
    want = crc64nvme(host[3:])
    for _ in range(20):
        assert crc(dev[3:]) == want
        assert other(dev[3:]) == want
        assert crc(dev[:5]) == crc64nvme(host[:5])


def test_other_launch_shapes(gpu, data):
    """The kernel's result does not depend on its grid (the probe times these shapes)."""
    cupy, stream, _, _, _ = gpu
    from gdsckpt.engine.gpu.kernels import Crc64Nvme
    host, dev = data
    for threads, bpsm, unroll, nibble in [(128, 8, 4, False), (256, 8, 4, False), (512, 2, 8, False),
                                          (256, 4, 4, True), (512, 2, 4, True), (256, 4, 4, False)]:
        crc = Crc64Nvme(stream, threads=threads, blocks_per_sm=bpsm, unroll=unroll, nibble=nibble)
        for n, start in [(0, 0), (5, 3), (8, 0), (17, 7), (4095, 1), ((4 << 20) + 3, 9)]:
            assert crc(dev[start:start + n]) == crc64nvme(host[start:start + n]), (threads, bpsm, nibble, n)


def test_legacy_sum_still_matches_cpu(gpu, data):
    """Format 1.0 files are read with the old sum: GPU and CPU values agree as before."""
    _, _, _, legacy, _ = gpu
    host, dev = data
    for n, start in [(0, 0), (1, 0), (13, 3), (4096, 8), ((4 << 20) + 3, 5)]:
        assert legacy(dev[start:start + n]) == legacy_sum64(host[start:start + n]), (n, start)


def test_refuses_strided_buffers(gpu, data):
    _, _, crc, _, _ = gpu
    with pytest.raises(ValueError):
        crc(data[1][::2])


def test_checksummer_is_the_current_algorithm(gpu):
    from gdsckpt.format import checksum as ck
    from gdsckpt.engine.gpu.kernels import ALGORITHMS
    assert gpu[4] is ALGORITHMS[ck.CURRENT]
