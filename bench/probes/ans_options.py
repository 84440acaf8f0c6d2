"""Typed-ANS ratio and speed against nvCOMP's internal chunk size, on the GPT-2-small state."""
import json, os, time
import cupy, torch
from nvidia import nvcomp
from gdsckpt.bench.workload import make_state
from gdsckpt.format.tree import flatten

state = make_state("gpt2-small", device="cuda")
leaves = flatten(state)[1]
streams = {}
for dt, typ in ((torch.bfloat16, "<f2"), (torch.float32, "<f4")):
    ts = [l.tensor.reshape(-1) for l in leaves if l.tensor.dtype == dt]
    streams[typ] = torch.cat(ts).view(torch.uint8)
rows = []
for typ, buf in streams.items():
    n = buf.numel() // (256 << 20) * (256 << 20) or buf.numel()
    for ucs in (65536, 131072, 262144, 524288, 1048576):
        try:
            c = nvcomp.Codec(algorithm="ANS", data_type=typ, uncomp_chunk_size=ucs)
        except Exception as e:
            rows.append({"type": typ, "ucs": ucs, "error": str(e)}); continue
        stored = 0; t = 0.0
        for off in range(0, n, 256 << 20):
            x = cupy.asarray(buf[off:off + (256 << 20)]).view(cupy.dtype(typ))
            a = nvcomp.as_array(x)
            c.encode(a); torch.cuda.synchronize()
            t0 = time.perf_counter(); r = c.encode(a); stored += r.buffer_size; torch.cuda.synchronize(); t += time.perf_counter() - t0
        rows.append({"type": typ, "ucs": ucs, "saved": round(1 - stored / n, 4), "gbps": round(n / t / 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "ans-options.json"), "w"), indent=1)
