"""The chunk checksum, as defined in FORMAT.md, for numpy (CPU) buffers.

It is a position-weighted sum over 64-bit words, so that the GPU computes the
very same value in one pass over device memory (gdsckpt/gpu/kernels.py) and a
machine with no GPU can still verify every chunk. It detects every single-bit
error and reordered words; it is not a cryptographic hash.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
LENGTH_MIX = 0xC2B2AE3D27D4EB4F
MASK = (1 << 64) - 1

_weights = np.zeros(0, dtype=np.uint64)


def _weights_for(n: int) -> np.ndarray:
    global _weights
    if len(_weights) < n:
        size = max(n, 2 * len(_weights))
        _weights = (np.arange(1, size + 1, dtype=np.uint64) * np.uint64(GOLDEN)) | np.uint64(1)
    return _weights[:n]


def checksum(buf) -> int:
    """Checksum of the bytes of `buf` (anything numpy can view as bytes)."""
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    n = len(data)
    whole = n // 8
    total = int(np.dot(data[: whole * 8].view("<u8"), _weights_for(whole))) if whole else 0
    if n % 8:
        tail = int.from_bytes(bytes(data[whole * 8:]), "little")
        total += tail * (((whole + 1) * GOLDEN & MASK) | 1)
    return (total + n * LENGTH_MIX) & MASK
