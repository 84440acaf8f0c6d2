"""Quick pipeline probe on the GPU: save throughput into the null and null-d2h sinks, and to disk,
across chunk sizes, on a synthetic ~4 GB state (bf16 weights + fp32 master/moments drawn like a
trained model's). Used to choose defaults; the committed figures come from gdsckpt-bench."""

import json
import os
import sys

import torch

import gdsckpt
from gdsckpt.bench.sinks import HostCopySink, NullSink

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
g = torch.Generator(device="cuda").manual_seed(0)
n = int(gb * 1e9 / 14)  # params: bf16 (2) + 3 x fp32 (12) bytes each
shape = (n // 4096, 4096)
w = torch.randn(shape, device="cuda", generator=g) * 0.02
state = {"model": {"w": w.to(torch.bfloat16)}, "master": {"w": w},
         "exp_avg": {"w": torch.randn(shape, device="cuda", generator=g) * 1e-4},
         "exp_avg_sq": {"w": (torch.randn(shape, device="cuda", generator=g) * 1e-4) ** 2}}
torch.cuda.synchronize()
res = []
for sink_name, sink in (("null", NullSink()), ("null-d2h", HostCopySink("cuda"))):
    for bs in (16 << 20, 64 << 20, 256 << 20):
        for depth in (2, 3):
            gdsckpt.save(state, None, chunk_bytes=bs, ring_depth=depth, _sink=sink)
            best = max((gdsckpt.save(state, None, chunk_bytes=bs, ring_depth=depth, _sink=sink) for _ in range(2)),
                       key=lambda s: s.gbps)
            row = {"sink": sink_name, "bs_mib": bs >> 20, "depth": depth, "gbps": round(best.gbps, 1),
                   "ratio": round(best.ratio, 4), "stages": {k: round(v, 4) for k, v in best.stages.items()},
                   "mem": best.memory}
            print(json.dumps(row), flush=True)
            res.append(row)
d = os.environ.get("PROBE_DIR", "/tmp/probe")
os.makedirs(d, exist_ok=True)
for bs in (64 << 20, 256 << 20):
    for threads in (1, 4):
        p = os.path.join(d, "p.gdsckpt")
        s = gdsckpt.save(state, p, chunk_bytes=bs, io_threads=threads)
        fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
        ck = gdsckpt.open(p, io_threads=threads)
        out = ck.load()
        torch.cuda.synchronize()
        ok = all(torch.equal(out[k]["w"], state[k]["w"]) for k in state)
        row = {"sink": "disk", "bs_mib": bs >> 20, "threads": threads, "save_gbps": round(s.gbps, 2),
               "load_gbps": round(ck.last_stats.gbps, 2), "ratio": round(s.ratio, 4), "io": s.io_path,
               "exact": ok, "save_stages": {k: round(v, 3) for k, v in s.stages.items()},
               "load_stages": {k: round(v, 3) for k, v in ck.last_stats.stages.items()}}
        print(json.dumps(row), flush=True)
        res.append(row)
        del out
        os.unlink(p)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
