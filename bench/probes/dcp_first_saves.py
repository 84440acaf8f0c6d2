"""Why does the first dcp.async_save + GdsckptWriter(optimizer=) inside --train's loop make the
optimizer step wait ~0.19 s, against ~0.02-0.03 s for the later ones (the bench's first DCP
overlap checkpoint of every run: 0.166 s and 0.205 s blocked)? The bench's GPT and loop, its
first save outside the loop as the bench takes it, then --saves saves every --interval steps.
Per save: the call, the optimizer step's time after it, and the staging's own stats
(GdsckptWriter.last_stats: its seconds, stages and memory figures).

    OUT=dir python bench/probes/dcp_first_saves.py [--saves 5] [--interval 20] [--size gpt2-medium] [--reserve]

--reserve: gdsckpt.reserve(state) first (the pool the staging compresses into); without it the
first staging finds the pool empty and copies the state on the GPU (device_copy.copy_first).
Writes dcp_first_saves.json (dcp_first_saves-reserve.json).

Backs: docs/dcp.md and docs/measured.md: gdsckpt.dcp.reserve makes DCP + GdsckptWriter(optimizer=)'s
first saves inside a loop as quick as later ones (0.043 s, none above 0.055 s) (bench/results/:
2026-11-24-h100-dcp-reserve/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed.checkpoint as dcp  # noqa: E402

from gdsckpt.bench import provenance  # noqa: E402
from gdsckpt.bench.train_loop import Batches, build  # noqa: E402
from gdsckpt.bench.train_methods import _process_group, checkpoint_state  # noqa: E402
from gdsckpt.dcp import CachedSavePlanner, GdsckptWriter  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--saves", type=int, default=5)
ap.add_argument("--interval", type=int, default=20)
ap.add_argument("--size", default="gpt2-medium")
ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself")
ap.add_argument("--reserve", action="store_true", help="gdsckpt.reserve(state) before the first save")
args = ap.parse_args()

device = args.device
model, opt, windows, info = build(args.size, device)
batches = Batches(windows, info["batch"], device)
root = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", "/tmp")))
_process_group()
planner = CachedSavePlanner(cache_key="probe")


def stats_of(w) -> dict:
    """The staging's figures from the writer's last Stats: its seconds, stages and memory."""
    s = w.last_stats
    return {} if s is None else {"seconds": s.seconds, "stages": s.stages, "memory": s.memory}


def step() -> float:
    """One training step; the seconds opt.step() took (a staging's hook wait lands here)."""
    idx = batches.next()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t = time.perf_counter()
    opt.step()
    took = time.perf_counter() - t
    loss.item()
    return took


def save(name: str):
    w = GdsckptWriter(root / name, optimizer=opt)
    t = time.perf_counter()
    fut = dcp.async_save(checkpoint_state(model, opt), storage_writer=w, planner=planner)
    call = time.perf_counter() - t
    return w, getattr(fut, "upload_completion", fut), call


for _ in range(10):
    step()
records = []
if args.reserve:
    import gdsckpt
    t = time.perf_counter()
    r = gdsckpt.reserve(checkpoint_state(model, opt), wait=True).result()
    records.append({"save": "reserve", "seconds": time.perf_counter() - t, "reservation": str(r)})
w, fut, call = save("first")  # as the bench's first save: outside the loop
waits = [step() for _ in range(3)]  # what the first staging makes the steps after it wait
fut.result()
records.append({"save": "first", "call_s": call, "opt_step_s": waits, **stats_of(w)})
steady = [step() for _ in range(args.interval)]
for i in range(args.saves):
    w, fut, call = save(f"s{i}")
    waits = [step() for _ in range(3)]
    for _ in range(args.interval - 3):
        step()
    fut.result()
    records.append({"save": i, "call_s": call, "opt_step_s": waits, **stats_of(w)})
    print(records[-1], flush=True)
out = {"probe": "dcp_first_saves", "args": vars(args), "provenance": provenance.stamp(device),
       "opt_step_s_steady_median": sorted(steady)[len(steady) // 2], "saves": records}
Path(os.environ.get("OUT", "."), f"dcp_first_saves{'-reserve' if args.reserve else ''}.json").write_text(json.dumps(out, indent=1, default=str))
