"""How fast can a new process get a memory-tier copy (a /dev/shm segment) onto the GPU and check it?

    OUT=dir python bench/probes/host_paths.py [--gib 4]

Issue 21's restore from memory must take <= 0.5 s for a 4.9 GB state (4.1 GB stored) on the H100.
A restoring process maps segments another process wrote. Measured here, on one segment of --gib
GiB of incompressible bytes:
  map        mmap of the existing file, and first touch of every page (MAP_POPULATE, or reading)
  h2d        host-to-device copies of 256 MiB pieces: from the pageable mapping, and after
             cudaHostRegister (what registering costs, per GB, for pages already in memory)
  crc        CRC-64/NVME (the format's checksum) with awscrt on the CPU: one thread, then 4/8/16
             threads over 256 MiB pieces (does awscrt release the GIL, and at what rate per core)
  cpu        the CPU model and the flags the CRC's fast paths use
Writes host_paths.json into $OUT.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from awscrt import checksums

PIECE = 256 << 20


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def _h2d(host: torch.Tensor, dev: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for off in range(0, host.numel(), PIECE):
        dev.copy_(host[off:off + PIECE], non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _crc(view: memoryview, threads: int) -> float:
    pieces = [view[o:o + PIECE] for o in range(0, len(view), PIECE)]
    t = time.perf_counter()
    if threads == 1:
        for p in pieces:
            checksums.crc64nvme(p)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(checksums.crc64nvme, pieces))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=4)
    args = ap.parse_args()
    n = args.gib << 30
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "bytes": n}
    path = Path("/dev/shm/gdsckpt-host-paths-probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as mm:  # the writer's mapping: fill it with incompressible bytes
            host = torch.frombuffer(mm, dtype=torch.uint8)
            dev = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
            t = time.perf_counter()
            for off in range(0, n, PIECE):
                dev.random_()
                host[off:off + PIECE].copy_(dev)
            out["fill_d2h_pageable_gbps"] = _rate(n, time.perf_counter() - t)
            del host
        # a new mapping of the same pages, as a restoring process makes
        t = time.perf_counter()
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        out["map_populate_s"] = round(time.perf_counter() - t, 4)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        view = memoryview(mm)
        dev = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
        _h2d(host[:PIECE], dev)
        out["h2d_pageable_gbps"] = [_rate(n, _h2d(host, dev)) for _ in range(2)]
        out["crc_gbps"] = {str(k): _rate(n, _crc(view, k)) for k in (1, 4, 8, 16)}
        t = time.perf_counter()
        err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 1))
        out["register_s"] = round(time.perf_counter() - t, 4)
        out["register_err"] = err
        if err == 0:
            out["register_gbps"] = _rate(n, out["register_s"])
            out["h2d_registered_gbps"] = [_rate(n, _h2d(host, dev)) for _ in range(2)]
            t = time.perf_counter()
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            out["unregister_s"] = round(time.perf_counter() - t, 4)
            for pieces in (4, 16):  # registering in pieces, as a tier of many arenas would
                step = n // pieces
                t = time.perf_counter()
                for off in range(0, n, step):
                    torch.cuda.cudart().cudaHostRegister(host.data_ptr() + off, step, 1)
                out[f"register_{pieces}_pieces_s"] = round(time.perf_counter() - t, 4)
                for off in range(0, n, step):
                    torch.cuda.cudart().cudaHostUnregister(host.data_ptr() + off)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        t = time.perf_counter()
        pinned.copy_(host)
        out["memcpy_to_pinned_gbps"] = _rate(n, time.perf_counter() - t)
        out["h2d_pinned_gbps"] = [_rate(n, _h2d(pinned, dev)) for _ in range(2)]
        del view, host, pinned
        mm.close()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
    out["cpu"] = {"model": next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if "Model name" in l), "?"),
                  "cores": os.cpu_count(),
                  "flags": [f for f in flags if f in ("pclmulqdq", "vpclmulqdq", "avx2", "avx512f", "avx512vl", "sse4_2")]}
    print(json.dumps(out, indent=1))
    Path(os.environ.get("OUT", "."), "host_paths.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
