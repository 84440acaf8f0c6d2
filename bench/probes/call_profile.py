"""Where an overlapped save_async's call, and its snapshot thread before the first chunk, spend
their time (issue 22, target 1: what precedes the snapshot's first device-to-host copy).

    OUT=dir python bench/probes/call_profile.py [--size gpt2-medium] [--saves 8]

The loop is gdsckpt-bench --train's (its GPT, AdamW, bf16 autocast, loss.item() every step).
After warm-up and gdsckpt.reserve, each save is save_async(state, snapshot="overlap",
optimizer=opt) on the bench's checkpoint state, then 30 training steps (the file written).
First the call's parts alone (state_dict, flatten, freeze_for_overlap). Per save, unprofiled:
the call's seconds (state_dict included, as in --train), and from the call's end the snapshot
thread's start, its first ring chunk (write_chunks entered) and its end.
Then the same saves under cProfile: once the call, once save_flat up to the ring in the snapshot
thread (on Python 3.12 a profile sees every thread: the other thread's functions show too, the
training's torch.nn ones during the prologue); the functions with the most own time per save.
Writes call_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import gdsckpt  # noqa: E402
from gdsckpt.bench.train_methods import checkpoint_state  # noqa: E402
from idle_trace import step, warm_loop  # noqa: E402

save_mod = sys.modules["gdsckpt.save"]  # the module (gdsckpt.save is the function)

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="gpt2-medium")
ap.add_argument("--saves", type=int, default=8)
ap.add_argument("--between", type=int, default=30)
args = ap.parse_args()

model, opt, batches, info = warm_loop(args.size, 5)
gdsckpt.reserve(checkpoint_state(model, opt)).result()
directory = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR")))

marks: dict = {}
profiles = {"call": cProfile.Profile(), "prologue": cProfile.Profile()}
profiling = [None]  # which profile this save runs: None, "call" or "prologue"
real_write_chunks, real_save_flat = save_mod.write_chunks, save_mod.save_flat


def write_chunks(*a, **k):
    marks.setdefault("ring", time.perf_counter())
    if profiling[0] == "prologue" and threading.current_thread().name == "gdsckpt-snapshot":
        profiles["prologue"].disable()
    return real_write_chunks(*a, **k)


def save_flat(*a, **k):
    marks.setdefault("thread", time.perf_counter())
    if profiling[0] == "prologue" and threading.current_thread().name == "gdsckpt-snapshot":
        profiles["prologue"].enable()
    try:
        return real_save_flat(*a, **k)
    finally:
        marks["end"] = time.perf_counter()


save_mod.write_chunks = write_chunks
gdsckpt.writing.async_save.save_flat = save_flat


def one(i: int, profile: str | None) -> dict:
    marks.clear()
    profiling[0] = profile
    t0 = time.perf_counter()
    if profile == "call":
        profiles["call"].enable()
    fut = gdsckpt.save_async(checkpoint_state(model, opt), directory / f"s{i}.gdsckpt", snapshot="overlap",
                             optimizer=opt)
    if profile == "call":
        profiles["call"].disable()
    t1 = time.perf_counter()
    for _ in range(args.between):
        step(model, opt, batches)
    fut.result()
    return {"profiled": profile, "call_ms": (t1 - t0) * 1e3,
            **{f"{k}_ms_after_call": (v - t1) * 1e3 for k, v in sorted(marks.items())}}


def phases() -> dict:
    """The call's parts one by one, unprofiled, each after a training step as in --train: the
    bench's state_dict, tree.flatten (the walk and its checks), freeze_for_overlap."""
    step(model, opt, batches)
    t0 = time.perf_counter()
    state = checkpoint_state(model, opt)
    t1 = time.perf_counter()
    _, leaves = gdsckpt.format.tree.flatten(state)
    t2 = time.perf_counter()
    gdsckpt.writing.snapshot.overlap.freeze_for_overlap([l.tensor for l in leaves], opt)
    t3 = time.perf_counter()
    return {"state_dict_ms": (t1 - t0) * 1e3, "flatten_ms": (t2 - t1) * 1e3, "freeze_ms": (t3 - t2) * 1e3}


parts = [phases() for _ in range(args.saves)]
rows = [one(i, kind) for kind in (None, "call", "prologue") for i in range(args.saves)]


def top(p: cProfile.Profile, n=40) -> list:
    st = pstats.Stats(p, stream=io.StringIO())
    out = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        out.append({"fn": f"{'/'.join(Path(file).parts[-2:])}:{line}:{fn}", "calls": nc, "own_ms": tt * 1e3 / args.saves,
                    "cum_ms": ct * 1e3 / args.saves})
    return sorted(out, key=lambda r: -r["own_ms"])[:n]


result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(), "size": args.size,
          "tensors": len(gdsckpt.format.tree.flatten(checkpoint_state(model, opt))[1]), "phases": parts, "saves": rows,
          "per_save_profile": {k: top(p) for k, p in profiles.items()}}
out = Path(os.environ.get("OUT", ".")) / "call_profile.json"
out.write_text(json.dumps(result, indent=1))
for r in parts:
    print({k: round(v, 2) for k, v in r.items()})
for r in rows:
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
for k in profiles:
    print(k)
    for r in result["per_save_profile"][k][:20]:
        print(f"  {r['own_ms']:7.2f} own {r['cum_ms']:7.2f} cum {r['calls'] / args.saves:7.0f}x  {r['fn']}")
