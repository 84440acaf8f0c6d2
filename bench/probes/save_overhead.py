"""Where a save's time goes outside the pipeline's stages, on the realistic 4 GB state:
per-call times of repeated null-target saves, a host profile of them, and durable saves to
one path (each replacing the last) against saves to fresh paths, with their commit times.
JSON to $OUT/save-overhead.json, the profile to $OUT/save-profile.txt."""

import cProfile
import gc
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench.workload import make_state

state = make_state("4GB", device="cuda")
sink = NullSink()
out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def null_loops(n):
    rows = []
    for _ in range(n):
        t = time.perf_counter()
        s = api.save_through(state, sink)
        rows.append({"seconds": time.perf_counter() - t, "gbps": s.gbps,
                     "stages": {k: round(v, 5) for k, v in s.stages.items()}})
    return rows


api.save_through(state, sink)  # warm-up
out["null"] = null_loops(8)
gc.disable()
out["null_gc_off"] = null_loops(8)
gc.enable()
prof = cProfile.Profile()
prof.enable()
null_loops(5)
prof.disable()
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
Path(os.environ.get("OUT", "."), "save-profile.txt").write_text(buf.getvalue())

d = Path("/tmp/overhead")
d.mkdir(exist_ok=True)
for mode in ("same path", "fresh paths"):
    rows = []
    for i in range(3):
        p = d / ("same.gdsckpt" if mode == "same path" else f"step{i}.gdsckpt")
        s = gdsckpt.save(state, p)
        rows.append({"gbps": s.gbps, "wait_io": s.stages.get("wait_io"), "commit": s.stages.get("commit"),
                     "seconds": s.seconds})
    out[mode] = rows
    for p in d.iterdir():
        p.unlink()
for k, v in out.items():
    print(k, json.dumps(v))
Path(os.environ.get("OUT", "."), "save-overhead.json").write_text(json.dumps(out, indent=1))
