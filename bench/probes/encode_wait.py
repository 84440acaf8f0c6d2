"""Does nvCOMP's Python encode wait (holding the GIL) for its own kernels, or for earlier work on its stream?

    OUT=dir python bench/probes/encode_wait.py

py-spy --gil (bench/results/2026-11-24-h100-idle/) found save_async's snapshot thread holding the GIL
inside `codec.encode` (gdsckpt/engine/gpu/codecs.py) for about the compression's GPU time. Timed here on one
256 MiB fp32 chunk (AdamW-moment-like values), ANS native bitstream as gdsckpt writes it, and RAW:
  call_ms   the encode call's own host time (GIL held throughout: a pybind11 call)
  sync_ms   the stream synchronize after it (GIL released)
  size_ms   reading result.buffer_sizes[0] after that synchronize (GIL held)
cases: the stream idle before the call; 20 ms of earlier work queued on the same stream
(torch.cuda._sleep); 20 ms of work on another stream; on the legacy default stream (training's);
a 256 MiB device-to-host copy into pinned memory on another stream (the snapshot's copy stream),
and the same with that stream synchronized before the sizes are read. Writes encode_wait.json.
"""
import json, os, time
import cupy, torch
from nvidia import nvcomp

torch.cuda.init()
ts = torch.cuda.Stream()
stream = cupy.cuda.ExternalStream(ts.cuda_stream)
other = torch.cuda.Stream()
n = 256 << 20
x = (torch.randn(n // 4, device="cuda") * 1e-3).abs().sqrt()  # exp_avg_sq-like magnitudes
src = cupy.asarray(x).view(cupy.uint8)
out = cupy.empty(int(n * 1.2), dtype=cupy.uint8)
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
cycles = int(20e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # ~20 ms of _sleep


def run(kind, case):
    opts = {"algorithm": "ANS", "device_id": 0, "cuda_stream": stream.ptr}
    if kind == "raw":
        opts["bitstream_kind"] = nvcomp.BitstreamKind.RAW
    opts["data_type"] = "<f4"
    codec = nvcomp.Codec(**opts)
    srcs = nvcomp.as_arrays(src.view(cupy.float32), [0], [n], cuda_stream=stream.ptr)
    outs = nvcomp.as_arrays(out, [0], [out.nbytes], cuda_stream=stream.ptr)
    cfg = codec.compression_config([n])
    rows = []
    for i in range(6):
        torch.cuda.synchronize()
        if case == "same-stream-busy":
            with torch.cuda.stream(ts):
                torch.cuda._sleep(cycles)
        elif case == "other-stream-busy":
            with torch.cuda.stream(other):
                torch.cuda._sleep(cycles)
        elif case == "default-stream-busy":
            torch.cuda._sleep(cycles)
        elif case.startswith("d2h-busy"):
            with torch.cuda.stream(other):
                pinned.copy_(x.view(torch.uint8), non_blocking=True)
        t0 = time.perf_counter()
        r = codec.encode(srcs, out=outs, compression_config=cfg)
        t1 = time.perf_counter()
        stream.synchronize()
        if case == "d2h-busy-wait":
            other.synchronize()
        t2 = time.perf_counter()
        size = r.buffer_sizes[0]
        t3 = time.perf_counter()
        rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        torch.cuda.synchronize()
    rows = rows[2:]
    return {"kind": kind, "case": case, "call_ms": [round(r[0], 2) for r in rows],
            "sync_ms": [round(r[1], 2) for r in rows], "size_ms": [round(r[2], 2) for r in rows],
            "saved": round(1 - size / n, 4)}


res = []
for kind in ("native", "raw"):
    for case in ("idle", "same-stream-busy", "other-stream-busy", "default-stream-busy", "d2h-busy", "d2h-busy-wait"):
        try:
            res.append(run(kind, case))
        except Exception as e:  # noqa: BLE001
            res.append({"kind": kind, "case": case, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(res[-1]), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "encode_wait.json"), "w").write(json.dumps(res, indent=1))
