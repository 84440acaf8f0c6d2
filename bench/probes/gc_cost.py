"""Full garbage collections a save_async causes in a training process (issue 22: the checkpoint's
cost on the training thread, beyond what a 20-checkpoint --train loop shows).

    python bench/probes/gc_cost.py [--saves 150] [--snapshot overlap] [--device cpu] [--output F]

The bench's GPT layout with tiny widths (24 layers: 1,172 tensors with AdamW's state), trained
on `--device`: `--saves` times, two steps then save_async(checkpoint_state) (waited for), and
first as many steps with no save. Python's collector runs as in any process (after one
gc.collect()); gc.callbacks time every collection by generation. A full collection walks every
tracked object of the process (torch's ~300k), so its cost per save is what to read: the
collections' seconds / saves. Prints and writes one JSON: per loop, collections and seconds by
generation, and the tracked objects the save's objects promoted to the oldest generation
(sampled over 10 saves after the loops).

Backs: README "save_async": saves pause Python's cyclic collector while they build their objects, so
a long run's full collections cost 1 ms a save instead of 8 (bench/results/: 2026-11-24-cpu-gc/,
2026-11-24-h100-collector/).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gdsckpt  # noqa: E402
from gdsckpt.bench import train_methods  # noqa: E402
from gdsckpt.bench.workload import GPT  # noqa: E402
from gdsckpt.format.tree import flatten  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--saves", type=int, default=150)
ap.add_argument("--snapshot", default="overlap", choices=("overlap", "host"))
ap.add_argument("--device", default="cpu")
ap.add_argument("--output")
args = ap.parse_args()

torch.manual_seed(0)
with torch.device(args.device):
    model = GPT(24, 4, 64, 256, 64)  # the bench's gpt2-medium depth, tiny widths: its tensor count
    tokens = torch.randint(0, 256, (2, 65))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step() -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()


directory = tempfile.mkdtemp()


def save() -> None:
    extra = {"optimizer": opt} if args.snapshot == "overlap" else {}
    fut = gdsckpt.save_async(train_methods.checkpoint_state(model, opt), os.path.join(directory, "c"),
                             snapshot=args.snapshot, **extra)
    step()  # an overlapped snapshot runs beside the next step, as in training
    fut.result()


timed: dict = {}
started: dict = {}


def on_gc(phase, info) -> None:
    g = info["generation"]
    if phase == "start":
        started[g] = time.perf_counter()
    else:
        n, s = timed.get(g, (0, 0.0))
        timed[g] = (n + 1, s + time.perf_counter() - started[g])


for _ in range(3):
    step()
save()
gc.collect()
t = time.perf_counter()
gc.collect()
report = {"probe": "gc_cost", "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
          "python": platform.python_version(), "torch": torch.__version__, "device": args.device,
          "snapshot": args.snapshot, "saves": args.saves, "tensors": len(flatten(
              train_methods.checkpoint_state(model, opt))[1]),
          "tracked_objects": len(gc.get_objects()), "one_full_collection_s": round(time.perf_counter() - t, 4),
          "loops": {}}
gc.callbacks.append(on_gc)
for loop in ("none", "save_async"):
    gc.collect()
    timed.clear()
    t = time.perf_counter()
    for _ in range(args.saves):
        step()
        if loop == "none":
            step()
        else:
            save()
    report["loops"][loop] = {"s": round(time.perf_counter() - t, 3), **{
        f"gen{g}": {"collections": n, "s": round(s, 4)} for g, (n, s) in sorted(timed.items())}}
    full = timed.get(2, (0, 0.0))
    report["loops"][loop]["full_collection_s_per_save"] = round(full[1] / args.saves, 5)
gc.callbacks.remove(on_gc)

# What the saves promote: new objects found in the oldest generation after each middle collection.
gc.collect()
before = {id(o) for o in gc.get_objects(2)}
promoted: collections.Counter = collections.Counter()
seen: set = set()


def on_middle(phase, info) -> None:
    if phase == "stop" and info["generation"] == 1:
        for o in gc.get_objects(2):
            if id(o) not in before and id(o) not in seen:
                seen.add(id(o))
                promoted[type(o).__qualname__] += 1


gc.callbacks.append(on_middle)
for _ in range(10):
    step()
    save()
gc.callbacks.remove(on_middle)
report["promoted_per_save"] = {"all": sum(promoted.values()) / 10,
                               **{k: v / 10 for k, v in promoted.most_common(8)}}
print(json.dumps(report, indent=1))
if args.output:
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
