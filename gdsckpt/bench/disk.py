"""The storage's own speed, measured beside the checkpoint it bounds: a raw O_DIRECT probe, and
the page-cache drop that makes every timed read cold. Shared by gdsckpt-bench, its baselines and
the probes under bench/probes/."""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def drop_page_cache(path) -> None:
    """fsync `path`, then evict its pages, so that the next read comes from storage. Dirty pages
    cannot be evicted, hence the fsync first. No effect on tmpfs (the data only lives in memory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_probe(directory: Path, nbytes: int, block: int = 64 << 20) -> dict:
    """Raw O_DIRECT write (fsync'd) and cold read of `nbytes` of unique random bytes: the storage's
    own speed. Every block differs (a random block XORed with a per-block key, made by a helper
    thread during the previous block's write): one block written over and over read back ~20%
    faster on the H100 host's disk than unique bytes do (bench/results/2026-11-22-h100-p/)."""
    nbytes = max(block, nbytes // block * block)
    base = np.frombuffer(os.urandom(block), dtype=np.uint64)
    bufs = [mmap.mmap(-1, block) for _ in range(2)]  # page aligned, as O_DIRECT wants
    words = [np.frombuffer(b, dtype=np.uint64) for b in bufs]

    def fill(i: int) -> None:
        np.bitwise_xor(base, np.uint64((i + 1) * 0x9E3779B97F4A7C15 % (1 << 64)), out=words[i % 2])

    path = Path(directory) / ".gdsckpt-bench-disk-probe"
    try:
        with ThreadPoolExecutor(1) as helper:
            fill(0)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            t = time.perf_counter()
            for i, off in enumerate(range(0, nbytes, block)):
                ahead = helper.submit(fill, i + 1)  # numpy and pwrite both release the GIL
                os.pwrite(fd, bufs[i % 2], off)
                ahead.result()
            os.fsync(fd)
            w = time.perf_counter() - t
            os.close(fd)
        drop_page_cache(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        t = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [bufs[0]], off)
        r = time.perf_counter() - t
        os.close(fd)
        return {"directory": str(directory), "bytes": nbytes, "direct_write_gbps": nbytes / w / 1e9,
                "direct_read_gbps": nbytes / r / 1e9}
    except OSError as e:  # tmpfs and some file systems refuse O_DIRECT
        return {"directory": str(directory), "bytes": nbytes, "error": f"{type(e).__name__}: {e}"}
    finally:
        path.unlink(missing_ok=True)


def mean_probe(probes: list[dict]) -> dict:
    """The probes' mean rates (those that did not fail), with every probe kept under "probes"."""
    ok = [p for p in probes if "error" not in p]
    mean = {k: sum(p[k] for p in ok) / len(ok) for k in ("direct_write_gbps", "direct_read_gbps")} if ok else {}
    return {"directory": probes[0]["directory"], "bytes": probes[0]["bytes"], **mean, "probes": probes}
