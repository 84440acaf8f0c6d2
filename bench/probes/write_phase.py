"""Does a background file write slow the training thread, and does it matter where the bytes
come from? (issue 22: --train's steps 2-30 after a checkpoint, while its file is written, were
+25..40 ms slower in all than the 'none' loop's on some machines, by per-position medians.)

    OUT=dir python bench/probes/write_phase.py [--gb 4] [--rounds 4]

The bench's GPT trains (idle_trace.step: bf16 autocast, AdamW, loss.item() every step) while one
thread writes --gb GB with os.pwritev and fsyncs, as gdsckpt's pool writer does, in turn:
  idle         nothing (between every two writes: the baseline next to each)
  small        O_DIRECT from one 64 MiB pinned buffer, written again and again (write_interference.py's)
  pool         O_DIRECT from a --gb GB pinned buffer, each byte once, in 256 MiB records of four
               64 MiB pieces (what a save_async's pool holds and how its writer writes it)
  pool-cold    the same after the buffer was written by the CPU (every page touched anew)
  pool-apart   as pool, the writer thread kept off the training thread's CPU (--pin-main pins the
               training thread to one CPU for the whole run; the writer gets every other one):
               does the write reach the training thread through its CPU (the disk's interrupts,
               the kernel's work for the write), or elsewhere?
--cases picks and orders them (an idle case runs before each other case).
Each case runs for --seconds of steps. Per case: the steps' median and mean, beyond the idle
cases' (the medians are what the slow steps every ~16 steps do not move: slow_steps.py), the
writer's GB/s and CPU seconds, the interrupts a second on every CPU and (with --pin-main) on the
training thread's. Writes write_phase.json.
"""
import argparse
import json
import os
import statistics as st
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))
from idle_trace import step, warm_loop  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--gb", type=float, default=4)
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--seconds", type=float, default=3.0)
ap.add_argument("--cases", default="small,pool,pool-cold")
ap.add_argument("--pin-main", type=int, default=None, help="pin the training thread to this CPU")
args = ap.parse_args()
CASES = args.cases.split(",")
if "pool-apart" in CASES and args.pin_main is None:
    ap.error("pool-apart keeps the writer off the training thread's CPU: pass --pin-main")
ALL_CPUS = os.sched_getaffinity(0)
if args.pin_main is not None:
    os.sched_setaffinity(0, {args.pin_main})  # this thread only (Linux: a thread's own mask)
model, opt, batches, info = warm_loop()
PIECE, RECORD = 64 << 20, 256 << 20
n = int(args.gb * 1e9) // RECORD * RECORD
small = torch.empty(PIECE, dtype=torch.uint8, pin_memory=True).random_(0, 255)
big = torch.empty(n, dtype=torch.uint8, pin_memory=True)
big.view(torch.int64).random_()
d = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))


def writer(case, out):
    if case == "pool-apart":
        os.sched_setaffinity(0, ALL_CPUS - {args.pin_main})
    t, c = time.perf_counter(), time.thread_time()
    if case != "idle":
        if case == "pool-cold":
            big.view(torch.int64).add_(1)
        fd = os.open(str(d / "w"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, n, RECORD):
            if case == "small":
                views = [memoryview(small.numpy())] * (RECORD // PIECE)
            else:
                views = [memoryview(big[off + p:off + p + PIECE].numpy()) for p in range(0, RECORD, PIECE)]
            os.pwritev(fd, views, off)
        os.fsync(fd)
        os.close(fd)
    out.update(seconds=time.perf_counter() - t, cpu_s=time.thread_time() - c)


def _irqs() -> list[int]:
    """Interrupts taken so far by each CPU, all sources (/proc/interrupts: the local timer's
    ticks included, ~250 a second on a busy CPU)."""
    try:
        lines = Path("/proc/interrupts").read_text().splitlines()
    except OSError:
        return []
    ncpu = len(lines[0].split())
    tot = [0] * ncpu
    for line in lines[1:]:
        f = line.split()[1:1 + ncpu]
        for i, x in enumerate(f):
            if x.isdigit():
                tot[i] += int(x)
    return tot


cases = []
for r in range(args.rounds):
    for case in [c for x in CASES for c in ("idle", x)]:
        out, times = {}, []
        th = threading.Thread(target=writer, args=(case, out))
        irq0 = _irqs()
        t0 = time.perf_counter()
        th.start()
        while time.perf_counter() - t0 < args.seconds:
            t = time.perf_counter()
            step(model, opt, batches)
            times.append((time.perf_counter() - t) * 1e3)
        th.join()
        span, irqs = time.perf_counter() - t0, [b - a for a, b in zip(irq0, _irqs())]
        cases.append({"case": case, "round": r, "steps_ms": [round(x, 2) for x in times],
                      "writer_s": round(out["seconds"], 3), "writer_cpu_s": round(out["cpu_s"], 3),
                      # per second of the case (its steps and the write): the training CPU's, every CPU's
                      "irqs_per_s_main_cpu": round(irqs[args.pin_main] / span) if args.pin_main is not None and irqs else None,
                      "irqs_per_s_all": round(sum(irqs) / span),
                      "gbps": round(n / out["seconds"] / 1e9, 2) if case != "idle" else None})
        for f in d.iterdir():
            f.unlink()
        print(case, r, f"median {st.median(times):.2f} mean {st.fmean(times):.2f} ms, writer {out['seconds']:.2f} s",
              flush=True)
summary = {}
idle = [x for c in cases if c["case"] == "idle" for x in c["steps_ms"]]
for name in ["idle"] + CASES:
    xs = [x for c in cases if c["case"] == name for x in c["steps_ms"]]
    summary[name] = {"steps": len(xs), "median_ms": round(st.median(xs), 2), "mean_ms": round(st.fmean(xs), 2),
                     "median_beyond_idle_ms": round(st.median(xs) - st.median(idle), 2),
                     "mean_beyond_idle_ms": round(st.fmean(xs) - st.fmean(idle), 2),
                     "gbps": [c["gbps"] for c in cases if c["case"] == name],
                     "writer_cpu_s": [c["writer_cpu_s"] for c in cases if c["case"] == name],
                     "irqs_per_s_main_cpu": [c["irqs_per_s_main_cpu"] for c in cases if c["case"] == name]}
    print(name, summary[name])
res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "gb": n / 1e9,
       "pin_main": args.pin_main, "cpus": os.cpu_count(),
       "summary": summary, "cases": cases}
Path(os.environ.get("OUT", "."), "write_phase.json").write_text(json.dumps(res, indent=1))
