"""Why does gdsckpt.save_async slow down under a training loop, and slow training in turn?

    OUT=dir python bench/probes/probe_train_profile.py [--size gpt2-medium] [--pyspy PATH]

The model, optimizer and loop are gdsckpt-bench --train's (gdsckpt/bench/train_loop.py, train_methods.py). Parts:

1. Isolation: one background save_async (today's: device snapshot, then gdsckpt.save on a
   thread) while the main thread does one of
     idle        sleeps;
     gpu-default torch.cuda._sleep kernels on torch's default stream (the legacy NULL stream,
                 which training uses), ~no Python;
     gpu-side    the same kernels on a non-default torch stream (created non-blocking);
     python      a pure-Python loop, no GPU;
     train       real training steps.
   Per load: the save's completion time, the main thread's progress rate against the same load
   without a save, and a heartbeat thread's wake-up latency (1 ms sleeps: time waiting for the
   GIL shows as lateness). If gpu-default slows the save and gpu-side does not, the save's
   work waits on the legacy stream (implicit synchronisation of a blocking stream), not on
   SMs or the GIL.
2. torch.profiler over training steps with a save_async in flight, reduced to: CUDA runtime and
   driver calls by name and thread (syncs, mallocs, frees, copies), GPU copies by kind and
   stream, kernels by stream, and how much of the non-training streams' device-to-host copy
   time overlapped a training-stream kernel.
3. py-spy record --gil --threads over the same kind of window (who holds the GIL, where).
4. sys.setswitchinterval(0.5 ms) against the default 5 ms, training + save.

Writes train_profile.json and train_profile.txt (the summary) into $OUT.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench import states, train_loop, train_methods  # noqa: E402

LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


class Heartbeat:
    """A thread that sleeps 1 ms at a time; lateness beyond the sleep is scheduling + GIL wait."""

    def __init__(self):
        self.late: list[float] = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t - 0.001)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.t.join()

    def summary(self) -> dict:
        v = sorted(self.late) or [0.0]
        q = lambda p: v[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
        return {"n": len(v), "p50_ms": q(0.5) * 1e3, "p99_ms": q(0.99) * 1e3, "max_ms": v[-1] * 1e3,
                "late_over_2ms_s": sum(x for x in v if x > 0.002)}


def sleep_cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles for about `seconds` (calibrated once)."""
    n = 10_000_000
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize()
    return max(1000, int(n * seconds / (time.perf_counter() - t)))


def load_fn(kind: str, ctx, batches, cycles):
    """One unit of main-thread work for `kind`; returns nothing. Each ends synchronized, so
    progress counts completed work."""
    if kind == "idle":
        return lambda: time.sleep(0.01)
    if kind == "gpu-default":
        def f():
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(cycles)
            torch.cuda.default_stream().synchronize()
        return f
    if kind == "gpu-side":
        side = torch.cuda.Stream()

        def f():
            with torch.cuda.stream(side):
                torch.cuda._sleep(cycles)
            side.synchronize()
        return f
    if kind == "python":
        def f():
            x = 0
            for i in range(20_000):
                x += i * i
        return f
    if kind == "train":
        hook = [0.0, 0.0]
        return lambda: train_loop.train_step(ctx.model, ctx.opt, batches, ctx.device, train_methods.NoCheckpoint(), hook)
    raise ValueError(kind)


def rate(fn, seconds: float) -> tuple[float, list[float]]:
    """Units per second of fn over `seconds`, and each unit's duration."""
    each = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        fn()
        each.append(time.perf_counter() - t)
    return len(each) / (time.perf_counter() - t0), each


def under_save(fn, state, path, tail: float = 0.0) -> dict:
    """Run fn repeatedly while one save_async is in flight (and `tail` s after)."""
    done = {}
    each = []
    with Heartbeat() as hb:
        t0 = time.perf_counter()
        fut = gdsckpt.save_async(state, path)
        blocked = time.perf_counter() - t0
        fut.add_done_callback(lambda f: done.setdefault("t", time.perf_counter()))
        while not fut.done():
            t = time.perf_counter()
            fn()
            each.append((t, time.perf_counter() - t))
        fut.result()
    completion = done["t"] - t0
    during = [d for t, d in each if t + d <= done["t"]]
    return {"blocked_s": blocked, "completion_s": completion, "units_during": len(during),
            "unit_mean_during_s": statistics.fmean(during) if during else None,
            "heartbeat": hb.summary()}


# ---------------------------------------------------------------- trace reduction

SYNC_WORDS = ("Synchronize", "Malloc", "Free", "Memcpy", "memcpy", "Memset", "HostAlloc", "HostRegister",
              "EventQuery", "StreamWait", "EventRecord", "StreamCreate", "cuMem", "cuStream", "cuEvent",
              "cuCtx", "LaunchKernel", "cuLaunch")


def reduce_trace(path: str, main_tid) -> dict:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X"]
    api = collections.defaultdict(lambda: [0, 0.0])
    gpu = collections.defaultdict(lambda: [0, 0.0, 0])
    kernels_by_stream: dict = collections.defaultdict(list)
    copies: dict = collections.defaultdict(list)
    tids = collections.Counter()
    for e in ev:
        cat = e.get("cat", "")
        name, dur = e.get("name", ""), float(e.get("dur", 0))
        args = e.get("args", {})
        if cat in ("cuda_runtime", "cuda_driver"):
            tid = e.get("tid")
            tids[tid] += 1
            if any(w in name for w in SYNC_WORDS):
                k = (name, "main" if tid == main_tid else f"tid {tid}")
                api[k][0] += 1
                api[k][1] += dur
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = args.get("stream")
            iv = (float(e["ts"]), float(e["ts"]) + dur)
            if cat == "kernel":
                kernels_by_stream[stream].append(iv)
                k = ("kernel", stream)
            else:
                copies[(name, stream)].append(iv)
                k = (name, stream)
            gpu[k][0] += 1
            gpu[k][1] += dur
            gpu[k][2] += int(args.get("bytes", 0) or 0)
    # The training stream: the one with the most kernel time.
    busy = {s: sum(b - a for a, b in iv) for s, iv in kernels_by_stream.items()}
    train_stream = max(busy, key=busy.get) if busy else None
    train_iv = sorted(kernels_by_stream.get(train_stream, []))

    ends = [d for _, d in train_iv]  # one stream's kernels run one at a time: ends are sorted too

    def overlap(ivs):
        tot, ov = 0.0, 0.0
        for a, b in ivs:
            tot += b - a
            j = bisect.bisect_right(ends, a)
            while j < len(train_iv) and train_iv[j][0] < b:
                c, d = train_iv[j]
                ov += max(0.0, min(b, d) - max(a, c))
                j += 1
        return tot, ov
    copy_overlap = {}
    for (name, stream), ivs in copies.items():
        if stream == train_stream:
            continue
        tot, ov = overlap(ivs)
        copy_overlap[f"{name} @ stream {stream}"] = {"ms": tot / 1e3, "overlapping_training_kernels_ms": ov / 1e3}
    other_kernels = {}
    for s, ivs in kernels_by_stream.items():
        if s != train_stream:
            tot, ov = overlap(ivs)
            other_kernels[f"stream {s}"] = {"n": len(ivs), "ms": tot / 1e3, "overlapping_training_kernels_ms": ov / 1e3}
    # Gaps in the training stream: idle time between its kernels.
    gaps = [c - b for (a, b), (c, d) in zip(train_iv, train_iv[1:]) if c > b]
    span = (train_iv[-1][1] - train_iv[0][0]) if train_iv else 0.0
    return {
        "events": len(ev), "api_threads": {str(k): v for k, v in tids.most_common()},
        "api": sorted(({"name": n, "thread": t, "n": c, "ms": d / 1e3} for (n, t), (c, d) in api.items()),
                      key=lambda r: -r["ms"]),
        "gpu": sorted(({"what": n, "stream": s, "n": c, "ms": d / 1e3, "bytes": b} for (n, s), (c, d, b) in gpu.items()),
                      key=lambda r: -r["ms"]),
        "training_stream": train_stream,
        "training_stream_busy_ms": busy.get(train_stream, 0) / 1e3, "training_stream_span_ms": span / 1e3,
        "training_stream_gaps_over_1ms": {"n": sum(1 for g in gaps if g > 1000), "ms": sum(g for g in gaps if g > 1000) / 1e3},
        "other_stream_copies": copy_overlap, "other_stream_kernels": other_kernels,
    }


def reduce_pyspy(path: str) -> dict:
    """py-spy --format raw: 'thread (0x..);frame (file:line);...  count' per line. Samples with the
    GIL per thread, and each thread's top frames (innermost three) with the GIL."""
    per_thread = collections.Counter()
    frames = collections.defaultdict(collections.Counter)
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        parts = stack.split(";")
        thread = parts[0]
        per_thread[thread] += int(n)
        frames[thread][" < ".join(p.split(" (")[0] for p in reversed(parts[-3:]))] += int(n)
    return {"samples_with_gil": dict(per_thread.most_common()),
            "top": {t: c.most_common(8) for t, c in frames.items()}}


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seconds", type=float, default=2.0, help="each no-save reference rate")
    ap.add_argument("--pyspy", default=None, help="path of the py-spy binary (skipped if absent)")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    size = a.size or ("gpt2-medium" if cuda else "small-cpu")
    model, opt, windows, minfo = train_loop.build(size, device)
    batches = train_loop.Batches(windows, minfo["batch"], device)
    ctx = train_methods.Ctx(model, opt, Path(a.dir or tempfile.mkdtemp(prefix="probe-train-")), device)
    ctx.directory.mkdir(parents=True, exist_ok=True)
    hook = [0.0, 0.0]
    for _ in range(5):
        train_loop.train_step(model, opt, batches, device, train_methods.NoCheckpoint(), hook)
    state = train_methods.checkpoint_state(model, opt)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": size, "model": minfo,
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    res["state_bytes"] = states.nbytes(state)
    n = [0]

    def path():
        n[0] += 1
        p = ctx.directory / f"p{n[0]}.gdsckpt"
        return p

    def clear():
        for p in ctx.directory.iterdir():
            p.unlink()
        os.sync()

    # sync save alone, twice (the first makes codecs and the ring)
    alone = []
    for i in range(2):
        t = time.perf_counter()
        s = gdsckpt.save(state, path())
        alone.append(time.perf_counter() - t)
        clear()
    res["save_alone_s"] = alone
    res["io_path"] = s.io_path
    log(f"{res['device']} {size} state {s.logical_bytes / 1e9:.2f} GB, stored {s.file_bytes / 1e9:.2f} GB, "
        f"io {s.io_path}; gdsckpt.save alone: {alone[0]:.2f} s (first), {alone[1]:.2f} s")

    # 1. isolation
    cycles = sleep_cycles(0.02) if cuda else 0
    loads = ["idle", "gpu-default", "gpu-side", "python", "train"] if cuda else ["idle", "python", "train"]
    iso = {}
    log("\n1. one save_async in flight while the main thread runs a load")
    log(f"{'load':<12}{'save done s':>12}{'blocked s':>10}{'unit ms alone':>14}{'unit ms w/ save':>16}"
        f"{'slowdown':>9}{'hb p50 ms':>10}{'hb p99 ms':>10}{'hb max ms':>10}{'hb late s':>10}")
    for kind in loads:
        fn = load_fn(kind, ctx, batches, cycles)
        fn()
        with Heartbeat() as hb0:
            r0, each0 = rate(fn, a.seconds)
        r = under_save(fn, train_methods.checkpoint_state(model, opt) if kind == "train" else state, path())
        clear()
        alone_unit = statistics.fmean(each0)
        r.update({"unit_mean_alone_s": alone_unit, "heartbeat_alone": hb0.summary()})
        iso[kind] = r
        slow = r["unit_mean_during_s"] / alone_unit if r["unit_mean_during_s"] else float("nan")
        h = r["heartbeat"]
        log(f"{kind:<12}{r['completion_s']:>12.2f}{r['blocked_s']:>10.3f}{alone_unit * 1e3:>14.2f}"
            f"{(r['unit_mean_during_s'] or 0) * 1e3:>16.2f}{slow:>9.2f}{h['p50_ms']:>10.2f}{h['p99_ms']:>10.2f}"
            f"{h['max_ms']:>10.1f}{h['late_over_2ms_s']:>10.3f}")
    res["isolation"] = iso
    log("  (hb: heartbeat thread's lateness over a 1 ms sleep while the save runs; alone-heartbeat in the JSON)")

    # 4. switch interval
    sw = {}
    for interval in (0.0005, 0.005):
        old = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        try:
            fn = load_fn("train", ctx, batches, cycles)
            sw[str(interval)] = under_save(fn, train_methods.checkpoint_state(model, opt), path())
        finally:
            sys.setswitchinterval(old)
        clear()
    res["switchinterval"] = sw
    log("\n4. training + save_async, sys.setswitchinterval: " + ", ".join(
        f"{k} s: save {v['completion_s']:.2f} s, step {(v['unit_mean_during_s'] or 0) * 1e3:.1f} ms"
        for k, v in sw.items()))

    # 2. torch.profiler over training with a save in flight
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn = load_fn("train", ctx, batches, cycles)
    main_tid = threading.get_native_id()
    trace = str(Path(tempfile.gettempdir()) / "probe_train_trace.json")
    with profile(activities=acts) as prof:
        for _ in range(2):
            fn()
        prof_save = under_save(fn, train_methods.checkpoint_state(model, opt), path())
        for _ in range(2):
            fn()
    clear()
    prof.export_chrome_trace(trace)
    try:
        red = reduce_trace(trace, main_tid)
    except Exception as e:
        red = {"error": f"{type(e).__name__}: {e}"}
    red["save"] = {k: prof_save[k] for k in ("blocked_s", "completion_s", "unit_mean_during_s")}
    res["profile"] = red
    log(f"\n2. torch.profiler: training with a save_async in flight (save {prof_save['completion_s']:.2f} s "
        "under the profiler)")
    if "error" in red:
        log(f"  trace reduction failed: {red['error']}")
    else:
        log(f"  events {red['events']}; API calls by thread id: {red['api_threads']} (main thread {main_tid})")
        log("  CUDA runtime/driver calls (sync, alloc, copy, stream/event), by thread, total ms:")
        for r in red["api"][:40]:
            log(f"    {r['name']:<44}{r['thread']:>14}{r['n']:>8}{r['ms']:>11.1f}")
        log(f"  GPU work by stream (training stream {red['training_stream']}: busy {red['training_stream_busy_ms']:.0f} ms "
            f"of {red['training_stream_span_ms']:.0f} ms; gaps >1 ms: {red['training_stream_gaps_over_1ms']})")
        for r in red["gpu"][:25]:
            log(f"    {r['what'][:44]:<44} stream {str(r['stream']):>4}{r['n']:>7}{r['ms']:>10.1f} ms"
                f"{r['bytes'] / 1e9:>9.2f} GB")
        log("  copies on other streams, and how much of them overlapped a training-stream kernel:")
        for k, v in red["other_stream_copies"].items():
            log(f"    {k[:60]:<60}{v['ms']:>9.1f} ms, overlapping {v['overlapping_training_kernels_ms']:.1f} ms")
        for k, v in red["other_stream_kernels"].items():
            log(f"    kernels {k:<52}{v['ms']:>9.1f} ms ({v['n']}), overlapping {v['overlapping_training_kernels_ms']:.1f} ms")

    # 3. py-spy --gil over training + save
    if a.pyspy and Path(a.pyspy).exists():
        try:
            libc = ctypes.CDLL(None)
            libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER_ANY
        except Exception:
            pass
        raw = str(out / "pyspy_gil.txt")
        dur = max(3, int(alone[-1] * 2.5) + 1)
        p = subprocess.Popen([a.pyspy, "record", "--pid", str(os.getpid()), "--gil", "--threads", "--nonblocking",
                              "--rate", "250", "--duration", str(dur), "--format", "raw", "-o", raw],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        t = time.perf_counter()
        spy_save = under_save(fn, train_methods.checkpoint_state(model, opt), path())
        while time.perf_counter() - t < dur - 0.5:
            fn()
        msg = p.communicate(timeout=60)[0]
        clear()
        res["pyspy"] = {"save": {k: spy_save[k] for k in ("completion_s", "unit_mean_during_s")},
                        "rc": p.returncode, "log": msg[-1500:]}
        if Path(raw).exists():
            red = reduce_pyspy(raw)
            res["pyspy"].update(red)
            log(f"\n3. py-spy --gil --threads, {dur} s of training with one save_async ({spy_save['completion_s']:.2f} s):")
            for th, c in red["samples_with_gil"].items():
                log(f"    {th}: {c} samples with the GIL ({c / (250 * dur):.1%} of the window)")
                for fr, k in red["top"][th][:6]:
                    log(f"        {k:>6}  {fr[:150]}")
        else:
            log(f"\n3. py-spy failed (rc {p.returncode}): {msg[-800:]}")
    else:
        log("\n3. py-spy: not run (no binary)")

    (out / "train_profile.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "train_profile.txt").write_text("\n".join(LOG) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
