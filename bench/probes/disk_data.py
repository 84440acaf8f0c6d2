"""Does the disk probe's data flatter the disk? The bench's probe writes one random 64 MiB block
over and over; storage that deduplicates or caches identical blocks would write (and read) that
faster than a checkpoint's unique bytes. Interleaved rounds of: the probe as it was (one block
repeated), the probe with every 4 KiB page of every block stamped with its position, the probe
from 4 GiB of unique random bytes, and a default gdsckpt save and cold load of the 4 GB state
(fresh file). JSON to $OUT/disk-data.json."""

import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.bench.disk import drop_page_cache
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench.workload import make_state

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
BLOCK, TOTAL = 64 << 20, 4 << 30
d = Path("/tmp/diskdata")
d.mkdir(exist_ok=True)
path = d / "probe.bin"

block = mmap.mmap(-1, BLOCK)
block.write(os.urandom(BLOCK))
pool = mmap.mmap(-1, TOTAL)  # unique random bytes, made on the GPU
np.frombuffer(pool, dtype=np.uint8)[:] = torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, device="cuda").cpu().numpy()
stamped = mmap.mmap(-1, BLOCK)
stamped.write(bytes(block))
words = np.frombuffer(stamped, dtype=np.uint64)


def probe(kind: str) -> dict:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t = time.perf_counter()
    for off in range(0, TOTAL, BLOCK):
        if kind == "same block":
            buf = block
        elif kind == "stamped pages":
            words[::512] = np.arange(off // 4096, off // 4096 + BLOCK // 4096, dtype=np.uint64)
            buf = stamped
        else:
            buf = memoryview(pool)[off:off + BLOCK]
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    w = time.perf_counter() - t
    os.close(fd)
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rbuf = mmap.mmap(-1, BLOCK)
    t = time.perf_counter()
    for off in range(0, TOTAL, BLOCK):
        os.preadv(fd, [rbuf], off)
    r = time.perf_counter() - t
    os.close(fd)
    path.unlink()
    os.sync()
    return {"write_gbps": TOTAL / w / 1e9, "read_gbps": TOTAL / r / 1e9}


state = make_state("4GB", device="cuda")
api.save_through(state, NullSink())
rows = []
for r in range(ROUNDS):
    for kind in ("same block", "stamped pages", "unique bytes"):
        rows.append({"round": r, "variant": f"probe: {kind}", **probe(kind)})
        print(json.dumps(rows[-1]), flush=True)
    p = d / f"s{r}.gdsckpt"
    s = gdsckpt.save(state, p)
    drop_page_cache(p)
    ck = gdsckpt.open(p)
    ck.load()
    torch.cuda.synchronize()
    rows.append({"round": r, "variant": "gdsckpt save / load (stored bytes)", "write_gbps": s.stored_bytes / s.seconds / 1e9,
                 "read_gbps": s.stored_bytes / ck.last_stats.seconds / 1e9, "ratio": s.ratio})
    print(json.dumps(rows[-1]), flush=True)
    p.unlink()
    os.sync()
Path(os.environ.get("OUT", "."), "disk-data.json").write_text(json.dumps(
    {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
     "bytes": TOTAL, "block": BLOCK, "rows": rows}, indent=1))
