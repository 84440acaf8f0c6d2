"""Issue 22's disk bound: a durable save against an O_DIRECT write of the same bytes, and a cold
restore against a multi-threaded O_DIRECT read of the same file, through each write path.

    OUT=dir python bench/probes/durable_paths.py [--size 6GB] [--loops 2] [--dir DIR]

State: the bench's realistic one (gdsckpt.bench.workload.make_state: GPT-shaped, AdamW moments
after real training steps, bf16 weights), on the GPU. Paths, each timed from the call to the
fsync'd rename (the file's stored bytes over that time is its rate):
  save            gdsckpt.save (KvikIO: compat here, GDS where nvidia-fs is)
  save-16t        gdsckpt.save with 16 KvikIO threads (default 4)
  pool-1GiB       save_async(pool_bytes=1 GiB).result(): D2H into a pinned pool, our O_DIRECT writer
  pool-state      save_async().result() with the default pool (the stored size)
Per file: the raw O_DIRECT write of its stored byte count (sequential 64 MiB blocks, fsync'd, as
gdsckpt-bench's disk probe), and cold reads of the file: gdsckpt.load_into (atomic=False and
True) against O_DIRECT reads of the whole file by 1, 4 and 8 threads. Writes durable_paths.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench.disk import disk_probe, drop_page_cache  # noqa: E402
from gdsckpt.bench.workload import make_state  # noqa: E402
from gdsckpt.tree import flatten  # noqa: E402

BLOCK = 64 << 20


def direct_read(path: Path, threads: int) -> float:
    """GB/s of O_DIRECT reads of the whole file, `threads` readers of interleaved 64 MiB blocks."""
    import mmap
    size = path.stat().st_size
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, BLOCK) for _ in range(threads)]

    def reader(k: int) -> None:
        for off in range(k * BLOCK, size, threads * BLOCK):
            os.preadv(fd, [bufs[k]], off)
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(reader, range(threads)))
        return size / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6GB")
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = ap.parse_args()
    d = Path(args.dir) / "gdsckpt-durable-paths"
    d.mkdir(parents=True, exist_ok=True)
    state = make_state(args.size, device="cuda")
    logical = sum(leaf.tensor.nbytes for leaf in flatten(state)[1])
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "size": args.size,
           "logical_bytes": logical, "directory": str(d), "paths": {}}
    paths = {
        "save": lambda p: gdsckpt.save(state, p),
        "save-16t": lambda p: gdsckpt.save(state, p, io_threads=16),
        "pool-1GiB": lambda p: gdsckpt.save_async(state, p, pool_bytes=1 << 30).result(),
        "pool-state": lambda p: gdsckpt.save_async(state, p).result(),
    }
    for name, fn in paths.items():
        p = d / f"{name}.gdsckpt"
        fn(p)  # untimed: first use (pool pinned, codecs made)
        rows = []
        for _ in range(args.loops):
            torch.cuda.synchronize()
            t = time.perf_counter()
            stats = fn(p)
            s = time.perf_counter() - t
            size = p.stat().st_size
            probe = disk_probe(d, size)
            rows.append({"seconds": round(s, 3), "file_bytes": size, "stored_gbps": round(size / s / 1e9, 3),
                         "direct_write_gbps": round(probe.get("direct_write_gbps", 0), 3),
                         "x_direct": round(size / s / 1e9 / probe["direct_write_gbps"], 3) if "direct_write_gbps" in probe else None,
                         "io_path": getattr(stats, "io_path", None)})
        out["paths"][name] = rows
        print(name, json.dumps(rows), flush=True)
    p = d / "save.gdsckpt"
    size = p.stat().st_size
    reads = {}
    for t in (1, 4, 8):
        reads[f"direct_read_{t}t_gbps"] = round(direct_read(p, t), 3)
    for atomic in (False, True):
        vals = []
        for _ in range(args.loops):
            drop_page_cache(p)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gdsckpt.load_into(p, state, atomic=atomic)
            torch.cuda.synchronize()
            vals.append(round(size / (time.perf_counter() - t0) / 1e9, 3))
        reads[f"load_into_atomic_{atomic}_stored_gbps"] = vals
    best = max(v for k, v in reads.items() if k.startswith("direct_read"))
    reads["x_best_direct_read"] = {k: [round(x / best, 3) for x in v] for k, v in reads.items() if k.startswith("load_into")}
    out["reads"] = reads
    print(json.dumps(reads), flush=True)
    for f in d.iterdir():
        f.unlink()
    Path(os.environ.get("OUT", "."), "durable_paths.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
