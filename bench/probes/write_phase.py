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
  small-process  as small, from another process (its own interpreter, its own 64 MiB buffer,
               page-aligned, not pinned): does the write reach the loop through this process
               (the interpreter's lock, the allocator), or through the machine?
--cases picks and orders them (an idle case runs before each other case).
Each case runs for --seconds of steps. Per case: the steps' median and mean, beyond the idle
cases' (the medians are what the slow steps every ~16 steps do not move: slow_steps.py), the
writer's GB/s and CPU seconds, the interrupts a second on every CPU and (with --pin-main) on the
training thread's, and the CPUs' time by kind from /proc/stat (steal: time the hypervisor ran
something else on a virtual CPU that wanted to run). Writes write_phase.json.

Backs: README "Measured" (issue 22's targets) and docs/measured.md: a checkpoint file's background
write slows the training steps beside it within noise, from another process within ~1 ms of none
(bench/results/: 2026-11-24-h100-write-window/, 2026-11-24-h100-steal/).
"""
import argparse
import json
import os
import statistics as st
import subprocess
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


CHILD = r"""
import mmap, os, sys, time
piece, record, n, path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
buf = mmap.mmap(-1, piece)
buf.write(os.urandom(piece))
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
for off in range(0, n, record):
    os.pwritev(fd, [memoryview(buf)] * (record // piece), off)
os.fsync(fd)
os.close(fd)
print(time.perf_counter() - t, time.process_time(), flush=True)
"""


def start_child():
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(PIECE), str(RECORD), str(n), str(d / "w")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def writer(case, out, child=None):
    if child is not None:  # small-process: the child writes; this thread only waits for it
        child.stdin.write("go\n")
        child.stdin.flush()
        seconds, cpu = map(float, child.stdout.readline().split())
        child.wait()
        out.update(seconds=seconds, cpu_s=cpu)
        return
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


KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _cpu_times() -> dict[str, list[int]]:
    """Each CPU's time so far by kind (/proc/stat, in USER_HZ ticks): {"cpu0": [user, ...], ...}."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    return {f[0]: [int(x) for x in f[1:1 + len(KINDS)]] for f in (line.split() for line in lines)
            if f[0].startswith("cpu") and f[0] != "cpu"}


def _cpu_seconds_per_s(before: dict, after: dict, span: float, cpus=None) -> dict[str, float]:
    """CPU seconds a second by kind, summed over `cpus` (names; None: all)."""
    hz = os.sysconf("SC_CLK_TCK")
    names = [c for c in after if c in before and (cpus is None or c in cpus)]
    return {k: round(sum(after[c][i] - before[c][i] for c in names) / hz / span, 3) for i, k in enumerate(KINDS)}


cases = []
for r in range(args.rounds):
    for case in [c for x in CASES for c in ("idle", x)]:
        out, times = {}, []
        child = start_child() if case == "small-process" else None
        th = threading.Thread(target=writer, args=(case, out, child))
        irq0, cpu0 = _irqs(), _cpu_times()
        t0 = time.perf_counter()
        th.start()
        while time.perf_counter() - t0 < args.seconds:
            t = time.perf_counter()
            step(model, opt, batches)
            times.append((time.perf_counter() - t) * 1e3)
        th.join()
        span, irqs, cpu1 = time.perf_counter() - t0, [b - a for a, b in zip(irq0, _irqs())], _cpu_times()
        cases.append({"case": case, "round": r, "steps_ms": [round(x, 2) for x in times],
                      "writer_s": round(out["seconds"], 3), "writer_cpu_s": round(out["cpu_s"], 3),
                      # per second of the case (its steps and the write): the training CPU's, every CPU's
                      "irqs_per_s_main_cpu": round(irqs[args.pin_main] / span) if args.pin_main is not None and irqs else None,
                      "irqs_per_s_all": round(sum(irqs) / span),
                      "cpu_s_per_s_all": _cpu_seconds_per_s(cpu0, cpu1, span),
                      "cpu_s_per_s_main_cpu": (_cpu_seconds_per_s(cpu0, cpu1, span, {f"cpu{args.pin_main}"})
                                               if args.pin_main is not None else None),
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
                     "irqs_per_s_main_cpu": [c["irqs_per_s_main_cpu"] for c in cases if c["case"] == name],
                     "steal_s_per_s_all": [c["cpu_s_per_s_all"]["steal"] for c in cases if c["case"] == name],
                     "softirq_s_per_s_all": [c["cpu_s_per_s_all"]["softirq"] for c in cases if c["case"] == name],
                     "system_s_per_s_all": [c["cpu_s_per_s_all"]["system"] for c in cases if c["case"] == name]}
    print(name, summary[name])
res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "gb": n / 1e9,
       "pin_main": args.pin_main, "cpus": os.cpu_count(),
       "summary": summary, "cases": cases}
Path(os.environ.get("OUT", "."), "write_phase.json").write_text(json.dumps(res, indent=1))
