"""Which way of moving compressed chunks between GPU memory and the local disk reaches the disk's
own O_DIRECT speed in compat mode? Interleaved rounds, so every variant sees the same disk weather.

Data: incompressible random bytes on the GPU (stand-ins for compressed chunks), cut into
`CHUNK` pieces laid out as gdsckpt lays chunks out (4 KiB-aligned offsets), at most two in flight
(the ring's depth). Writes are fsync'd; reads are cold (page cache dropped). JSON to
$OUT/io-paths.json.
"""

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cupy
import kvikio
import kvikio.defaults
import torch

from gdsckpt.bench.disk import disk_probe, drop_page_cache

TOTAL = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 4 << 30
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
CHUNK = 215 << 20  # a 256 MiB fp32 chunk after typed ANS (0.84)
DEPTH = 2
d = Path(os.environ.get("PROBE_DIR", "/tmp/iopaths"))
d.mkdir(parents=True, exist_ok=True)
path = d / "chunks.bin"

dev = torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, device="cuda")
pieces = [(o, min(CHUNK, TOTAL - o)) for o in range(0, TOTAL, CHUNK)]


def align(n):
    return (n + 4095) // 4096 * 4096


offsets, pos = [], 4096
for _, n in pieces:
    offsets.append(pos)
    pos = align(pos + n)


def cp(t):
    return cupy.asarray(t)


def kvikio_device(task, bounce, threads):
    def run(mode, target):  # "w": write `target` to the file; "r": read the file into it
        direct = "auto_direct_io_write" if mode == "w" else "auto_direct_io_read"
        with kvikio.defaults.set({"task_size": task, "bounce_buffer_size": bounce, "num_threads": threads,
                                  direct: True, "compat_mode": kvikio.CompatMode.ON}):
            f = kvikio.CuFile(path, mode)
            io = f.pwrite if mode == "w" else f.pread
            futs = []
            for (o, n), fo in zip(pieces, offsets):
                if len(futs) >= DEPTH:
                    futs.pop(0).get()
                futs.append(io(cp(target[o:o + n]), n, fo, task))
            for x in futs:
                x.get()
            if mode == "w":
                os.fsync(f.fileno())
            f.close()
    return (lambda: run("w", dev)), (lambda out: run("r", out))


host = [torch.empty(align(CHUNK), dtype=torch.uint8, pin_memory=True) for _ in range(DEPTH)]
pool = ThreadPoolExecutor(DEPTH)


def write_staged(submit, wait):
    """Each chunk copied into the pinned host ring (padded to 4 KiB) once its slot's last write is
    done, then submit(host array, file offset) -> a future that wait() completes."""
    futs = [None] * DEPTH
    for i, ((o, n), fo) in enumerate(zip(pieces, offsets)):
        s = i % DEPTH
        if futs[s] is not None:
            wait(futs[s])
        h = host[s]
        h[:n].copy_(dev[o:o + n])
        h[n:align(n)].zero_()
        futs[s] = submit(h.numpy()[:align(n)], fo)
    for x in futs:
        if x is not None:
            wait(x)


def staged_pwrite():
    """Pinned host ring + one O_DIRECT pwrite per chunk (padded to 4 KiB), as the disk probe writes."""
    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        write_staged(lambda a, fo: pool.submit(os.pwrite, fd, memoryview(a), fo), lambda f: f.result())
        os.fsync(fd)
        os.close(fd)

    def read(out):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        futs = [None] * DEPTH
        todo = list(zip(pieces, offsets))

        def submit(i):
            (_, n), fo = todo[i]
            return pool.submit(os.preadv, fd, [memoryview(host[i % DEPTH].numpy())[:align(n)]], fo)
        for i in range(min(DEPTH, len(todo))):
            futs[i] = submit(i)
        for i, ((o, n), fo) in enumerate(todo):
            s = i % DEPTH
            futs[s].result()
            out[o:o + n].copy_(host[s][:n])  # pinned host-to-device, waits
            if i + DEPTH < len(todo):
                futs[s] = submit(i + DEPTH)
        os.close(fd)
    return write, read


def kvikio_host(task, threads):
    def write():
        with kvikio.defaults.set({"task_size": task, "num_threads": threads, "auto_direct_io_write": True,
                                  "compat_mode": kvikio.CompatMode.ON}):
            f = kvikio.CuFile(path, "w")
            write_staged(lambda a, fo: f.pwrite(a, a.nbytes, fo, task), lambda fut: fut.get())
            os.fsync(f.fileno())
            f.close()
    return write, None


VARIANTS = {
    "kvikio-device task4M bounce16M t4 (gdsckpt default)": kvikio_device(4 << 20, 16 << 20, 4),
    "kvikio-device task16M bounce16M t4": kvikio_device(16 << 20, 16 << 20, 4),
    "kvikio-device task64M bounce64M t4": kvikio_device(64 << 20, 64 << 20, 4),
    "kvikio-device task32M bounce32M t8": kvikio_device(32 << 20, 32 << 20, 8),
    "pinned staging + kvikio-host task64M t4": kvikio_host(64 << 20, 4),
    "pinned staging + one O_DIRECT pwrite per chunk": staged_pwrite(),
}

rows = []
out = torch.empty_like(dev)
for r in range(ROUNDS):
    p = disk_probe(d, TOTAL)
    rows.append({"round": r, "variant": "probe (64 MiB O_DIRECT, 1 thread)", "write_gbps": p.get("direct_write_gbps"),
                 "read_gbps": p.get("direct_read_gbps")})
    print(json.dumps(rows[-1]), flush=True)
    for name, (write, read) in VARIANTS.items():
        path.unlink(missing_ok=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        write()
        w = time.perf_counter() - t
        row = {"round": r, "variant": name, "write_gbps": TOTAL / w / 1e9}
        if read is not None:
            drop_page_cache(path)
            out.zero_()
            torch.cuda.synchronize()
            t = time.perf_counter()
            read(out)
            torch.cuda.synchronize()
            row["read_gbps"] = TOTAL / (time.perf_counter() - t) / 1e9
            row["read_exact"] = bool(torch.equal(out, dev))
        rows.append(row)
        print(json.dumps(row), flush=True)
path.unlink(missing_ok=True)
json.dump({"device": torch.cuda.get_device_name(), "bytes": TOTAL, "chunk": CHUNK, "depth": DEPTH,
           "kvikio": kvikio.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "io-paths.json"), "w"), indent=1)
