"""Which steps of the bench's 'none' loop are slow, and why: GC collections (gc.callbacks), the
main thread's CPU time, with and without automatic GC (300 steps each: on, off, on).

    OUT=dir python bench/probes/slow_steps.py

Per mode: the steps' median, mean, p90 and max, collections per generation, and each step slower
than the median + 8 ms with its CPU time and the collections inside it. Writes slow_steps.json.
"""
import gc
import json
import os
import statistics as st
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from idle_trace import step, warm_loop  # noqa: E402

model, opt, b, info = warm_loop()
events = []


def cb(phase, info):
    events.append((phase, info["generation"], time.perf_counter()))


gc.callbacks.append(cb)
out = {}
for mode in ("gc-on", "gc-off", "gc-on2"):
    if mode == "gc-off":
        gc.disable()
    else:
        gc.enable()
    events.clear()
    rows = []
    for i in range(300):
        t, c = time.perf_counter(), time.thread_time()
        n0 = len(events)
        step(model, opt, b)
        rows.append({"ms": (time.perf_counter() - t) * 1e3, "cpu_ms": (time.thread_time() - c) * 1e3,
                     "gc": [(g, round((t1 - t0) * 1e3, 2)) for (p0, g, t0), (p1, _, t1) in zip(events[n0::2], events[n0 + 1::2])]})
    ms = [r["ms"] for r in rows]
    slow = [i for i, r in enumerate(rows) if r["ms"] > st.median(ms) + 8]
    out[mode] = {"median": st.median(ms), "mean": st.fmean(ms), "p90": sorted(ms)[270], "max": max(ms),
                 "slow": [(i, round(rows[i]["ms"], 1), round(rows[i]["cpu_ms"], 1), rows[i]["gc"]) for i in slow],
                 "gc_per_gen": {g: sum(1 for r in rows for gg, _ in r["gc"] if gg == g) for g in (0, 1, 2)},
                 "cpu_ms_median": st.median(r["cpu_ms"] for r in rows)}
    print(mode, {k: v for k, v in out[mode].items() if k != "slow"})
    for s in out[mode]["slow"][:25]: print("   ", s)
Path(os.environ.get("OUT", "."), "slow_steps.json").write_text(json.dumps(out, indent=1))
