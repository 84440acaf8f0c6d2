"""zstd parameters on byte-shuffled frames of the 350 MB CPU state (fp32 and bf16 planes, 1 MiB frames): CPU-time throughput, ratio, decode speed; item 3 of bench/results/2026-11-23-cpu-compare/README.md. Run: .venv/bin/python bench/probes/sweep_zstd_params.py"""
import time, torch, numpy as np, zstandard as Z, itertools
from gdsckpt.bench import workload
from gdsckpt.format import tree
from gdsckpt.engine.cpu_backend import shuffle_bytes  # noqa: E402
state = workload.make_state("350MB", device="cpu")
_, leaves = tree.flatten(state)
streams = {}
for l in leaves:
    streams.setdefault(l.tensor.dtype, []).append(l.tensor.reshape(-1).view(torch.uint8).numpy())
streams = {k: np.concatenate(v) for k, v in streams.items()}
C=16<<20; F=1<<20
frames=[]; n=0
for dt, a in streams.items():
    w = {torch.float32:4, torch.bfloat16:2}[dt]
    ch = [a[o:o+C] for o in range(0, len(a), C)]
    ch = [ch[i] for i in np.linspace(0, len(ch)-1, 6 if w==4 else 2).astype(int)]
    sh = [shuffle_bytes(c, w, np.empty(len(c), np.uint8)) for c in ch]
    frames += [x[o:o+F] for x in sh for o in range(0, len(x), F)]
n = sum(map(len, frames))
def tt(f, reps=3):
    best=1e9
    for _ in range(reps):
        t=time.thread_time(); r=f(); best=min(best, time.thread_time()-t)
    return best, r
d = Z.ZstdDecompressor()
res=[]
cands = [("level1", Z.ZstdCompressor(level=1))]
for hl, mm, wl in itertools.product((6, 7, 8), (7,), (16, 17, 18)):
    cands.append(((hl, mm, wl), Z.ZstdCompressor(compression_params=Z.ZstdCompressionParameters.from_level(1, hash_log=hl, chain_log=max(hl, 6), min_match=mm, window_log=wl, strategy=1))))
for rep in range(2):
    for name, c in cands:
        t, o = tt(lambda: [c.compress(f) for f in frames], 2)
        td, _ = tt(lambda: [d.decompress(x) for x in o], 2)
        res.append((name, n/t/1e9, sum(map(len, o))/n, n/td/1e9))
import collections
agg = collections.defaultdict(list)
for name, a, b, c in res: agg[name].append((a, b, c))
rows = sorted(((min(x[0] for x in v), v[0][1], min(x[2] for x in v), k) for k, v in agg.items()), reverse=True)
for r in rows[:12] + [x for x in rows if x[3] == "level1"]: print("comp %.2f GB/s ratio %.4f dec %.2f" % r[:3], r[3])
