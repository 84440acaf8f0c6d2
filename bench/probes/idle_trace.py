"""Where does a save_async's GPU idle time go? A torch.profiler trace around one checkpoint.

    OUT=dir python bench/probes/idle_trace.py [--size gpt2-medium] [--modes host,overlap]

The loop is gdsckpt-bench --train's (its GPT, AdamW, bf16 autocast, loss.item() every step, so the
host waits for the GPU at each step's end). After warm-up and one untimed save (the pool pinned),
each mode gets a trace of --before steps, the save_async call, and --after steps. Per step:
  wall_ms        the step's host time
  train_busy_ms  kernel time on the training stream inside the step (clipped to it)
  idle_ms        wall - train_busy: the training stream with nothing to run
  other_ms       kernel time on other streams (the snapshot's) inside the step
  d2h_ms, d2h_gb device-to-host copy time and bytes on other streams inside the step
and the training stream's gaps over 1 ms after the call, each with the main thread's innermost
operator at the gap's start (a named wait: the optimizer's hook, a copy, a sync; none: Python).
Extra idle of the checkpoint = the call's own time + the steps' idle beyond the median idle of
the steps before it. Writes idle_trace.json and, per mode, a filtered gzip trace into $OUT.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench import train_loop, train_methods  # noqa: E402


def step(model, opt, batches):
    idx = batches.next()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    with record_function("opt.step"):
        opt.step()
    return loss.item()


def analyse(trace: dict, before: int, after: int) -> dict:
    ev = trace["traceEvents"]
    ann = {e["name"]: e for e in ev if e.get("cat") == "user_annotation" and e.get("ph") == "X"}
    steps = [ann[f"step{i}"] for i in range(before + after)]
    call = ann.get("save_async")
    main_tid = steps[0]["tid"]
    kernels = [e for e in ev if e.get("cat") == "kernel" and e.get("ph") == "X"]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X"]
    busy: dict = {}
    for k in kernels:
        s = steps[0]
        if s["ts"] <= k["ts"] <= s["ts"] + s["dur"]:
            busy[k["args"]["stream"]] = busy.get(k["args"]["stream"], 0) + k["dur"]
    train = max(busy, key=busy.get)

    def within(evs, s, pred):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        return sum(max(0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) for e in evs if pred(e))

    rows = []
    for i, s in enumerate(steps):
        tb = within(kernels, s, lambda e: e["args"]["stream"] == train)
        d2h = [e for e in copies if e["args"]["stream"] != train and "DtoH" in e["name"]]
        lo, hi = s["ts"], s["ts"] + s["dur"]
        rows.append({"step": i - before, "wall_ms": s["dur"] / 1e3, "train_busy_ms": tb / 1e3,
                     "idle_ms": (s["dur"] - tb) / 1e3,
                     "other_ms": within(kernels, s, lambda e: e["args"]["stream"] != train) / 1e3,
                     "d2h_ms": within(d2h, s, lambda e: True) / 1e3,
                     "d2h_gb": sum(e["args"].get("bytes", 0) for e in d2h if lo <= e["ts"] < hi) / 1e9})
    base = statistics.median(r["idle_ms"] for r in rows[:before])
    base_wall = statistics.median(r["wall_ms"] for r in rows[:before])
    extra_idle = (call["dur"] / 1e3 if call else 0) + sum(r["idle_ms"] - base for r in rows[before:])
    extra_wall = (call["dur"] / 1e3 if call else 0) + sum(r["wall_ms"] - base_wall for r in rows[before:])
    # the training stream's gaps after the call, and what the main thread was in at each
    tk = sorted((e for e in kernels if e["args"]["stream"] == train and e["ts"] >= steps[before]["ts"]),
                key=lambda e: e["ts"])
    cpu = [e for e in ev if e.get("ph") == "X" and e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "user_annotation")]
    gaps = []
    for a, b in zip(tk, tk[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 1000:
            t = a["ts"] + a["dur"]
            inner = [e for e in cpu if e["ts"] <= t <= e["ts"] + e["dur"]]
            inner.sort(key=lambda e: e["dur"])
            gaps.append({"at_ms": round((t - steps[before]["ts"]) / 1e3, 2), "gap_ms": round(g / 1e3, 2),
                         "main_thread_in": [e["name"] for e in inner[:3]]})
    gaps.sort(key=lambda g: -g["gap_ms"])
    return {"train_stream": train, "call_ms": call["dur"] / 1e3 if call else None, "base_idle_ms": base,
            "base_wall_ms": base_wall, "extra_idle_ms": round(extra_idle, 2), "extra_wall_ms": round(extra_wall, 2),
            "steps": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
            "gaps": gaps[:25]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpt2-medium")
    ap.add_argument("--modes", default="host,overlap")
    ap.add_argument("--before", type=int, default=3)
    ap.add_argument("--after", type=int, default=6)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--loop-saves", type=int, default=0,
                    help="no trace: N saves of the first mode, one every 12 steps (to run under py-spy --gil)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    model, opt, windows, info = train_loop.build(args.size, "cuda")
    batches = train_loop.Batches(windows, info["batch"], "cuda")
    for _ in range(args.warm):
        step(model, opt, batches)
    d = Path(tempfile.mkdtemp(dir=os.environ.get("TRACE_DIR")))
    t = time.perf_counter()
    first = gdsckpt.save_async(train_methods.checkpoint_state(model, opt), d / "first").result()
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "model": info,
              "first_save": {"blocked_s": first.blocked_s, "pool_alloc_s": first.pool_alloc_s,
                             "to_durable_s": time.perf_counter() - t, "io_path": first.io_path}, "modes": {}}
    if args.loop_saves:
        mode = args.modes.split(",")[0]
        kw = {"snapshot": mode, "optimizer": opt} if mode == "overlap" else {"snapshot": mode}
        t = time.perf_counter()
        for i in range(args.loop_saves * 12):
            step(model, opt, batches)
            if i % 12 == 11:
                gdsckpt.save_async(train_methods.checkpoint_state(model, opt), d / mode, **kw)
        gdsckpt.save_async(train_methods.checkpoint_state(model, opt), d / mode, **kw).result()
        print(json.dumps({"mode": mode, "saves": args.loop_saves, "seconds": time.perf_counter() - t}))
        return
    for mode in args.modes.split(","):
        for _ in range(3):
            step(model, opt, batches)
        kw = {"snapshot": mode, "optimizer": opt} if mode == "overlap" else {"snapshot": mode}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.before + args.after):
                with record_function(f"step{i}"):
                    step(model, opt, batches)
                if i == args.before - 1:
                    with record_function("save_async"):
                        fut = gdsckpt.save_async(train_methods.checkpoint_state(model, opt), d / mode, **kw)
            torch.cuda.synchronize()
        stats = fut.result()
        raw = d / f"{mode}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        r = analyse(trace, args.before, args.after)
        r["stats"] = {k: getattr(stats, k) for k in ("blocked_s", "snapshot_s", "hook_wait_s", "background_s",
                                                       "pool_wait_s", "io_path", "file_bytes") if hasattr(stats, k)}
        result["modes"][mode] = r
        keep = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "user_annotation")
                or (e.get("cat") == "cpu_op" and e.get("dur", 0) > 200) or e.get("ph") == "M"]
        with gzip.open(out_dir / f"trace-{mode}.json.gz", "wt") as f:
            json.dump({"traceEvents": keep}, f)
        raw.unlink()
        print(mode, json.dumps({k: r[k] for k in ("call_ms", "extra_idle_ms", "extra_wall_ms", "base_wall_ms")}),
              json.dumps(r["gaps"][:8]), flush=True)
    (out_dir / "idle_trace.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
