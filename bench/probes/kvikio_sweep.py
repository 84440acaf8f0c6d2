"""Sweep KvikIO's knobs for the disk save and cold restore of the realistic state: I/O threads,
task size, O_DIRECT in compat mode, and the ring depth. Writes JSON to $OUT/kvikio-sweep.json.
Used to choose gdsckpt's defaults (see README); each row is one durable save and one cold load."""

import itertools
import json
import os
import sys

import kvikio.defaults
import torch

import gdsckpt
from gdsckpt.bench.disk import disk_probe, drop_page_cache
from gdsckpt.bench.states import nbytes
from gdsckpt.bench.workload import make_state
from pathlib import Path

size = sys.argv[1] if len(sys.argv) > 1 else "4GB"
d = Path(os.environ.get("SWEEP_DIR", "/tmp/sweep"))
d.mkdir(parents=True, exist_ok=True)
state = make_state(size, device="cuda")
logical = nbytes(state)
rows = [{"disk": disk_probe(d, 4 << 30), "logical_bytes": logical}]
print(rows[0], flush=True)
p = d / "s.gdsckpt"
GRID = {"threads": (1, 4, 8), "task": (4 << 20, 16 << 20), "direct": (False, True), "depth": (2, 4)}
if os.environ.get("SWEEP_GRID") == "large-tasks":  # the second sweep: larger I/O per task
    GRID = {"threads": (1, 2, 4), "task": (32 << 20, 64 << 20), "direct": (True,), "depth": (2, 3)}
for threads, task, direct, depth in itertools.product(*GRID.values()):
    with kvikio.defaults.set({"task_size": task, "auto_direct_io_write": direct, "auto_direct_io_read": direct}):
        s = gdsckpt.save(state, p, io_threads=threads, ring_depth=depth)
        drop_page_cache(p)
        ck = gdsckpt.open(p, io_threads=threads, ring_depth=depth)
        out = ck.load()
        torch.cuda.synchronize()
        del out
    row = {"threads": threads, "task_mib": task >> 20, "direct": direct, "depth": depth,
           "save_gbps": round(s.gbps, 3), "load_gbps": round(ck.last_stats.gbps, 3), "ratio": round(s.ratio, 4),
           "io": s.io_path, "save_wait_io": round(s.stages.get("wait_io", 0), 3),
           "load_read_wait": round(ck.last_stats.stages.get("read_wait", 0), 3)}
    print(json.dumps(row), flush=True)
    rows.append(row)
p.unlink(missing_ok=True)
name = "kvikio-sweep-large-tasks.json" if os.environ.get("SWEEP_GRID") else "kvikio-sweep.json"
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), name), "w"), indent=1)
