"""Where does a checkpoint's GPU idle time go? A torch.profiler trace around one checkpoint.

    OUT=dir python bench/probes/idle_trace.py [--size gpt2-medium] [--methods async,async-overlap,dcp-gdsckpt]

The loop is gdsckpt-bench --train's (its GPT, AdamW, bf16 autocast, loss.item() every step, so the
host waits for the GPU at each step's end). After warm-up and one untimed save (the pool pinned),
each method (gdsckpt-bench --train's: its setup, its save call) gets a trace of --before steps, the
call, and --after steps (36 covers the background write of the file too). Per step:
  wall_ms        the step's host time
  train_busy_ms  kernel time on the training stream inside the step (clipped to it)
  idle_ms        wall - train_busy: the training stream with nothing to run
  other_ms       kernel time on other streams (the snapshot's) inside the step
  d2h_ms, d2h_gb device-to-host copy time and bytes on other streams inside the step
and the training stream's gaps over 1 ms after the call, each with the main thread's innermost
operator at the gap's start (a named wait: the optimizer's hook, a copy, a sync; none: Python).
Extra idle of the checkpoint = the call's own time + the steps' idle beyond the median idle of
the steps before it. Writes idle_trace.json and, per method, a filtered gzip trace into $OUT.

Backs: README "Measured" (issue 22's targets) and docs/measured.md "Where the idle goes": the trace
of a checkpoint's GPU idle time (the host mode bound by its D2H copy; the overlap mode's snapshot
thread held the GIL in nvCOMP's size read, fixed) (bench/results/: 2026-11-24-h100-idle/,
2026-11-24-h100-fixed-costs/, 2026-11-24-h100-priority/).
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

from gdsckpt.bench import train_loop, train_methods  # noqa: E402


def train_with_defaults(methods: str, output: str) -> int:
    """gdsckpt-bench --train on this process's command line, with these defaults where it names
    none: --methods `methods`, --output $OUT/`output`, --directory $BENCH_DIR or /tmp/bench (the
    probes that add a method to --train's)."""
    from gdsckpt.bench import cli
    argv = sys.argv[1:]
    defaults = {"--methods": methods, "--output": str(Path(os.environ.get("OUT", ".")) / output),
                "--directory": os.environ.get("BENCH_DIR", "/tmp/bench")}
    for option, value in defaults.items():
        if option not in argv:
            argv += [option, value]
    return cli.main(["--train", *argv])


def step(model, opt, batches):
    """One step with no checkpoint method (warm-up; write_interference's loop)."""
    return method_step(model, opt, batches, train_methods.Method())


def warm_loop(size: str = "gpt2-medium", warm: int = 10):
    """gdsckpt-bench --train's model, optimizer and batches of `size` on the GPU, after `warm`
    steps: (model, opt, batches, info). The probes that time that loop start here."""
    model, opt, windows, info = train_loop.build(size, "cuda")
    batches = train_loop.Batches(windows, info["batch"], "cuda")
    for _ in range(warm):
        step(model, opt, batches)
    return model, opt, batches, info


def analyse(trace: dict, before: int, after: int) -> dict:
    ev = trace["traceEvents"]
    ann = {e["name"]: e for e in ev if e.get("cat") == "user_annotation" and e.get("ph") == "X"}
    steps = [ann[f"step{i}"] for i in range(before + after)]
    call = ann.get("checkpoint")
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

    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"]
    rows = []
    for i, s in enumerate(steps):
        tb = within(kernels, s, lambda e: e["args"]["stream"] == train)
        lo, hi = s["ts"], s["ts"] + s["dur"]
        mine = [e for e in runtime if e["tid"] == main_tid and lo <= e["ts"] < hi]
        d2h = [e for e in copies if e["args"]["stream"] != train and "DtoH" in e["name"]]
        rows.append({"main_runtime_ms": sum(e["dur"] for e in mine) / 1e3, "main_runtime_calls": len(mine),
                     "main_runtime_max_ms": max((e["dur"] for e in mine), default=0) / 1e3,
                     "other_threads_runtime_ms": within(runtime, s, lambda e: e["tid"] != main_tid) / 1e3,
                     "step": i - before, "wall_ms": s["dur"] / 1e3, "train_busy_ms": tb / 1e3,
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
            "gaps": gaps[:25], "other_threads_longest_runtime": [
                {"name": e["name"], "tid": e["tid"], "ms": e["dur"] / 1e3,
                 "at_ms": round((e["ts"] - steps[before]["ts"]) / 1e3, 2)}
                for e in sorted((e for e in runtime if e["tid"] != main_tid and e["ts"] >= steps[0]["ts"]),
                                key=lambda e: -e["dur"])[:15]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpt2-medium")
    ap.add_argument("--methods", default="async,async-overlap",
                    help="gdsckpt-bench --train's methods (train_methods.ALIASES), e.g. async,dcp-gdsckpt")
    ap.add_argument("--before", type=int, default=3)
    ap.add_argument("--after", type=int, default=6, help="steps traced after the call (36: the file's write too)")
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--loop-saves", type=int, default=0,
                    help="no trace: N saves of the first method, one every 12 steps (to run under py-spy --gil)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    model, opt, batches, info = warm_loop(args.size, args.warm)
    d = Path(tempfile.mkdtemp(dir=os.environ.get("TRACE_DIR")))
    ctx = train_methods.Ctx(model, opt, d, "cuda")
    asked = args.methods.split(",")
    methods = [m for m in train_methods.select(args.methods) if m.name != "none" or "none" in asked]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "model": info,
              "first_save": {}, "methods": {}}
    for m in methods:  # setup (a reservation, a process group) and one untimed save: steady state after
        m.setup(ctx)
        if m.name == "none":
            continue
        t = time.perf_counter()
        m.save(ctx, ctx.state(), d / f"first-{len(result['first_save'])}").result()
        result["first_save"][m.name] = {"to_durable_s": time.perf_counter() - t, "io_path": ctx.io_path}
    if args.loop_saves:
        m = methods[0]
        t = time.perf_counter()
        for i in range(args.loop_saves * 12):
            method_step(model, opt, batches, m)
            if i % 12 == 11:
                m.save(ctx, ctx.state(), d / f"loop-{i}")
        m.save(ctx, ctx.state(), d / "loop-last").result()
        print(json.dumps({"method": m.name, "saves": args.loop_saves, "seconds": time.perf_counter() - t}))
        return
    for n, m in enumerate(methods):
        for _ in range(3):
            method_step(model, opt, batches, m)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.before + args.after):
                with record_function(f"step{i}"):
                    method_step(model, opt, batches, m)
                if i == args.before - 1 and m.name != "none":
                    with record_function("checkpoint"):
                        fut = m.save(ctx, ctx.state(), d / f"traced-{n}")
            torch.cuda.synchronize()
        stats = fut.result() if m.name != "none" else None
        raw = d / f"trace-{n}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        r = analyse(trace, args.before, args.after)
        r["stats"] = {k: getattr(stats, k) for k in ("blocked_s", "snapshot_s", "hook_wait_s", "background_s",
                                                       "pool_wait_s", "io_path", "file_bytes") if hasattr(stats, k)}
        result["methods"][m.name] = r
        main_tid = next(e["tid"] for e in trace["traceEvents"] if e.get("name") == "step0")
        keep = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "user_annotation")
                or (e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
                    and (e.get("dur", 0) > 200 or e.get("tid") != main_tid))  # every call of the snapshot's threads
                or e.get("ph") == "M"]
        with gzip.open(out_dir / f"trace-{n}.json.gz", "wt") as f:
            json.dump({"traceEvents": keep}, f)
        raw.unlink()
        print(m.name, json.dumps({k: r[k] for k in ("call_ms", "extra_idle_ms", "extra_wall_ms", "base_wall_ms")}),
              json.dumps(r["gaps"][:8]), flush=True)
    for m in methods:
        m.teardown()
    (out_dir / "idle_trace.json").write_text(json.dumps(result, indent=1))


def method_step(model, opt, batches, method) -> None:
    """One step of the loop, with the method's wait before the optimizer step (the overlap modes)."""
    idx = batches.next()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    method.before_step()
    with record_function("opt.step"):
        opt.step()
    return loss.item()


if __name__ == "__main__":
    main()
