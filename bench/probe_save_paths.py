"""Durable saves of the realistic 4 GB state through different compat-mode write settings,
interleaved with the O_DIRECT probe so that every variant sees the same disk weather. Each
save goes to a fresh name (no replaced file to free). JSON to $OUT/save-paths.json."""

import json
import os
import sys
import time
from pathlib import Path

import kvikio.defaults
import torch

import gdsckpt
from gdsckpt.bench.disk import disk_probe
from gdsckpt.bench.workload import make_state

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
d = Path("/tmp/savepaths")
d.mkdir(exist_ok=True)
state = make_state("4GB", device="cuda")
VARIANTS = {  # name: (env GDSCKPT_COMPAT_STAGING, io_threads, KvikIO task_size, bounce_buffer_size)
    "default: 4 threads, 4 MiB tasks, 16 MiB bounce": ("0", 4, 4 << 20, 16 << 20),
    "1 thread, 64 MiB tasks, 64 MiB bounce": ("0", 1, 64 << 20, 64 << 20),
    "8 threads, 16 MiB tasks, 16 MiB bounce": ("0", 8, 16 << 20, 16 << 20),
    "pinned staging, 4 threads, 64 MiB tasks": ("1", 4, 64 << 20, 16 << 20),
}
rows, n = [], 0
gdsckpt.save(state, None, _sink=__import__("gdsckpt.bench.sinks", fromlist=["NullSink"]).NullSink())
for r in range(ROUNDS):
    p = disk_probe(d, 4 << 30)
    rows.append({"round": r, "variant": "probe", "write_gbps": p["direct_write_gbps"]})
    print(json.dumps(rows[-1]), flush=True)
    for name, (staging, threads, task, bounce) in VARIANTS.items():
        os.environ["GDSCKPT_COMPAT_STAGING"] = staging
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
