"""An overlapped snapshot's timeline, from one of idle_trace.py's gzip traces: when the snapshot
thread started and ended, when the pool's device-to-host copies ran and how long the copy engine
stood idle between them, how long the snapshot's kernels waited to start once launched and free to run (for SMs the
training's kernels held),
and when the optimizer step came (times in ms from the save call's end). With --kernels, for any
method's trace (the host mode's ring runs inside the call): the checkpoint's GPU time by kernel,
every kernel off the training stream from the call's start to 300 ms after it.

    python bench/probes/snapshot_timeline.py [--kernels] trace-0.json.gz [...]

The snapshot thread is the thread other than the training one with the most CUDA runtime calls
in the 20 ms after the call; the copy stream is the stream with the most device-to-host bytes.

Backs: docs/measured.md: at the highest stream priority, with sizes read from nvCOMP's header, the
overlapped snapshot's copies run back to back and it ends at 93 ms instead of 134; its GPU work by
kernel (28.9 ms for 4.9 GB) (bench/results/: 2026-11-24-h100-priority/, 2026-11-24-h100-fused/).
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def timeline(path: str) -> dict:
    ev = json.load(gzip.open(path, "rt"))["traceEvents"]
    ann = {e["name"]: e for e in ev if e.get("cat") == "user_annotation" and e.get("ph") == "X"}
    call, main = ann["checkpoint"], ann["step0"]["tid"]
    t0 = call["ts"] + call["dur"]

    def ms(us: float) -> float:
        return round(us / 1e3, 2)
    calls = collections.Counter(e.get("tid") for e in ev if e.get("cat") == "cuda_runtime"
                                and e.get("tid") != main and t0 < e["ts"] < t0 + 20_000)
    thread = sorted((e for e in ev if e.get("tid") == calls.most_common(1)[0][0] and e.get("ph") == "X"),
                    key=lambda e: e["ts"])
    d2h = collections.Counter()
    for e in ev:
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"] and t0 < e["ts"] < t0 + 300_000:
            d2h[e["args"]["stream"]] += e["args"].get("bytes", 0)
    stream = d2h.most_common(1)[0][0]
    copies = sorted((e for e in ev if e.get("cat") == "gpu_memcpy" and e["args"].get("stream") == stream
                     and "DtoH" in e["name"] and e["ts"] > t0), key=lambda e: e["ts"])
    gaps = [(b["ts"] - a["ts"] - a["dur"], a["ts"] + a["dur"]) for a, b in zip(copies, copies[1:])]
    gaps = [(ms(end - t0), ms(g)) for g, end in gaps if g > 50]
    # The snapshot's kernels: how long each waited to start once it was launched and its stream's
    # earlier work had ended (waiting for SMs the training's kernels held).
    launched = {e["args"].get("correlation"): e["ts"] for e in thread if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ours = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy") and e["ts"] > t0
                   and e["args"].get("correlation") in launched), key=lambda e: e["ts"])
    queued, ended = [], {}
    for e in ours:
        s = e["args"]["stream"]
        if e.get("cat") == "kernel":
            queued.append(max(0.0, e["ts"] - max(launched[e["args"]["correlation"]], ended.get(s, 0.0))))
        ended[s] = max(ended.get(s, 0.0), e["ts"] + e["dur"])
    step = next(e for e in sorted(ev, key=lambda e: e["ts"]) if e.get("name") == "opt.step" and e["ts"] > t0)
    return {"call_ms": ms(call["dur"]), "snapshot_thread_ms": [ms(thread[0]["ts"] - t0), ms(thread[-1]["ts"] + thread[-1]["dur"] - t0)],
            "copies": len(copies), "copy_gb": round(sum(e["args"]["bytes"] for e in copies) / 1e9, 3),
            "copy_ms": [ms(copies[0]["ts"] - t0), ms(copies[-1]["ts"] + copies[-1]["dur"] - t0)],
            "copy_busy_ms": ms(sum(e["dur"] for e in copies)), "copy_idle_ms": round(sum(g for _, g in gaps), 2),
            "copy_idle_gaps": gaps, "snapshot_kernels": len(queued),
            "kernel_queued_ms": {"total": ms(sum(queued)), "max": ms(max(queued, default=0)),
                                 "over_1ms": sum(q > 1000 for q in queued)}, "optimizer_step_at_ms": ms(step["ts"] - t0),
            "step_after_ms": ms(ann[f"step{sum(1 for k in ann if k.startswith('step') and ann[k]['ts'] < call['ts'])}"]["dur"])}


def kernels(path: str) -> dict:
    ev = json.load(gzip.open(path, "rt"))["traceEvents"]
    ann = {e["name"]: e for e in ev if e.get("cat") == "user_annotation" and e.get("ph") == "X"}
    call, first = ann["checkpoint"], ann["step0"]
    busy: collections.Counter = collections.Counter()
    for e in ev:
        if e.get("cat") == "kernel" and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]:
            busy[e["args"]["stream"]] += e["dur"]
    train = busy.most_common(1)[0][0]
    by_kernel: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in ev:
        if (e.get("cat") == "kernel" and e["args"]["stream"] != train
                and call["ts"] <= e["ts"] <= call["ts"] + call["dur"] + 300_000):
            name = e["name"].split("<")[0].split("(")[0][:60]  # cut at template arguments
            by_kernel[name] += e["dur"]
            count[name] += 1
    return {"total_ms": round(sum(by_kernel.values()) / 1e3, 2),
            "by_kernel": {k: {"ms": round(v / 1e3, 2), "launches": count[k]} for k, v in by_kernel.most_common()}}


if __name__ == "__main__":
    paths = [p for p in sys.argv[1:] if p != "--kernels"]
    of = kernels if "--kernels" in sys.argv else timeline
    print(json.dumps({p: of(p) for p in paths}, indent=1))
