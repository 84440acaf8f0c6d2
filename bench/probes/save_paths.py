"""Durable saves of the realistic 4 GB state through different compat-mode write settings,
interleaved with the O_DIRECT probe so that every variant sees the same disk weather. Each
save goes to a fresh name (no replaced file to free). JSON to $OUT/save-paths.json.

The 2026-11-22 runs (round K) had a fourth variant, gdsckpt's own pinned host staging
(GDSCKPT_COMPAT_STAGING=1): within the disk's noise, and since removed from the library."""

import json
import os
import sys
import time
from pathlib import Path

import kvikio.defaults
import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.bench.disk import disk_probe
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench.workload import make_state

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
d = Path("/tmp/savepaths")
d.mkdir(exist_ok=True)
state = make_state("4GB", device="cuda")
VARIANTS = {  # name: (io_threads, KvikIO task_size, bounce_buffer_size)
    "default: 4 threads, 4 MiB tasks, 16 MiB bounce": (4, 4 << 20, 16 << 20),
    "1 thread, 64 MiB tasks, 64 MiB bounce": (1, 64 << 20, 64 << 20),
    "8 threads, 16 MiB tasks, 16 MiB bounce": (8, 16 << 20, 16 << 20),
}
rows, n = [], 0
api.save_through(state, NullSink())  # warm-up: codecs, kernels, memory pools
for r in range(ROUNDS):
    p = disk_probe(d, 4 << 30)
    rows.append({"round": r, "variant": "probe", "write_gbps": p["direct_write_gbps"]})
    print(json.dumps(rows[-1]), flush=True)
    for name, (threads, task, bounce) in VARIANTS.items():
        with kvikio.defaults.set({"task_size": task, "bounce_buffer_size": bounce}):
            path = d / f"s{n}.gdsckpt"
            n += 1
            s = gdsckpt.save(state, path, io_threads=threads)
        rows.append({"round": r, "variant": name, "gbps": s.gbps, "stored_gbps": s.stored_bytes / s.seconds / 1e9,
                     "wait_io": s.stages.get("wait_io"), "commit": s.stages.get("commit"), "seconds": s.seconds,
                     "ratio": s.ratio})
        print(json.dumps(rows[-1]), flush=True)
        path.unlink()
        os.sync()  # free its blocks now, untimed, not inside the next save
Path(os.environ.get("OUT", "."), "save-paths.json").write_text(json.dumps(
    {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
     "rows": rows}, indent=1))
