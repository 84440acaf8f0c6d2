"""Issue 22's own kind of loop, not the bench's: a Hugging Face GPT-2-medium (transformers'
GPT2LMHeadModel, 355M parameters, tied embeddings, random init), AdamW, bf16 autocast, loss.item()
every step, a checkpoint every --interval steps of {"model", "optimizer", "step"}. Overhead per
checkpoint = (loop s - the same repeat's loop with no checkpoint) / checkpoints, 'none' and each
method's loops alternated; beside it the bench's local estimate (train_report: the call and the
steps after each checkpoint beyond the quiet steps around it, less the same in the 'none' loop).

    OUT=dir python bench/probes/hf_loop.py [--steps 440] [--interval 40] [--repeats 2]
        [--methods async,overlap] [--batch 8] [--seq 1024] [--tiny]

Methods: async = gdsckpt.save_async(state, path); overlap = the same with snapshot="overlap",
optimizer=opt; checkpointer = the README's pattern, gdsckpt.Checkpointer(dir, keep=2).save_async(
step, {"model": model, "optimizer": opt, "step": i}, optimizer=opt) (the objects in the state: their
state_dict() is taken inside the call; the Checkpointer's retention thread deletes). Each method
saves once before its loops (its first save: pool pinned, codecs chosen) and keeps the last two
checkpoints on disk; async and overlap delete older ones on a thread of their own as the bench
does (unlinking a 4 GB file took 1-2 s on the H100 VM's ext4, mounted with `discard`).
A loop drains its last save inside its time.
--tiny: 2 layers of width 64 on the CPU (a smoke test). Writes hf_loop.json.

Backs: README "save_async" and docs/measured.md: in a Hugging Face GPT2LMHeadModel loop, save_async
overlap costs 0.029 +- 0.029 s a checkpoint, the host mode 0.055 +- 0.027 s, and the README's
Checkpointer pattern what the bare save_async costs (bench/results/: 2026-11-24-h100-hf-loop/,
2026-11-24-h100-hf-checkpointer/).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics as st
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench import provenance, train_report as tr  # noqa: E402
from gdsckpt.bench.train_loop import Batches, Loop, Retention  # noqa: E402
from gdsckpt.bench.workload import token_windows  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=440)
ap.add_argument("--interval", type=int, default=40)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--methods", default="async,overlap")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--tiny", action="store_true")
args = ap.parse_args()

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

cuda = torch.cuda.is_available() and not args.tiny
device = "cuda" if cuda else "cpu"
shape = dict(n_layer=2, n_embd=64, n_head=4) if args.tiny else dict(n_layer=24, n_embd=1024, n_head=16)
seq = 64 if args.tiny else args.seq
config = GPT2Config(n_positions=1024, vocab_size=50257, **shape)
torch.manual_seed(0)
model = GPT2LMHeadModel(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
batches = Batches(token_windows(config.vocab_size, seq), args.batch, device)
root = Path(tempfile.mkdtemp(prefix="hf-loop-", dir=os.environ.get("TMPDIR", "/tmp")))


def step() -> float:
    x = batches.next()[:, :seq]  # windows of seq + 1 tokens; the model shifts the labels itself
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


checkpointer = None  # the "checkpointer" method's, made on first use
checkpointer_steps = itertools.count()  # its steps only grow, across loops


def save(method: str, i: int):
    global checkpointer
    if method == "checkpointer":  # the README's pattern: the objects in the state, the overlap mode
        if checkpointer is None:
            checkpointer = gdsckpt.Checkpointer(root / method, keep=2)
        return checkpointer.save_async(next(checkpointer_steps), {"model": model, "optimizer": opt, "step": i},
                                       optimizer=opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": i}
    path = root / method / f"step_{i:06d}.gdsckpt"
    if method == "overlap":
        return gdsckpt.save_async(state, path, snapshot="overlap", optimizer=opt)
    return gdsckpt.save_async(state, path)


def loop(method: str) -> Loop:
    (root / method).mkdir(exist_ok=True)
    steps, calls, done, ckpts, pending = [], [], [], [], []
    retention = Retention()  # the bench's: older checkpoints deleted on a thread of their own
    t_loop = time.perf_counter()
    for i in range(1, args.steps + 1):
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
        if method != "none" and i % args.interval == 0 and i + args.interval <= args.steps:
            t = time.perf_counter()
            fut = save(method, i)
            calls.append(time.perf_counter() - t)
            ckpts.append(i)
            k = len(done)
            done.append(None)
            fut.add_done_callback(lambda f, k=k, t=t: done.__setitem__(k, time.perf_counter() - t))
            pending.append(fut)
            if method != "checkpointer":  # which keeps its own last two
                retention.saved(root / method / f"step_{i:06d}.gdsckpt", fut)
    for f in pending:
        f.result()
    seconds = time.perf_counter() - t_loop
    retention.join()
    return Loop(seconds, calls=calls, completion=done, steps=steps, ckpt_steps=ckpts)


methods = [m for m in args.methods.split(",") if m]
for _ in range(10):  # warm-up: kernels, allocator, AdamW's state
    step()
firsts = {}
for m in methods:
    (root / m).mkdir(exist_ok=True)
    t = time.perf_counter()
    fut = save(m, 0)
    first_blocked = time.perf_counter() - t
    step()  # an overlapped snapshot runs during the next step
    stats = fut.result()
    firsts[m] = {"blocked_s": round(first_blocked, 4), "durable_s": round(time.perf_counter() - t, 3),
                 "io_path": stats.io_path, "backend": stats.backend}
loops: dict[str, list[Loop]] = {m: [] for m in ["none"] + methods}
for r in range(args.repeats):
    for m in ["none"] + methods:
        loops[m].append(loop(m))
        print(f"repeat {r + 1}: {m} {loops[m][-1].seconds:.2f} s", flush=True)
ckpts = len(loops[methods[0]][0].ckpt_steps) if methods else 0
summary = {}
for m in methods:
    over = [(l.seconds - n.seconds) / ckpts for l, n in zip(loops[m], loops["none"])]
    local = tr._local_summary(loops[m], loops["none"], args.interval)
    summary[m] = {"overhead_per_ckpt_s": [round(x, 4) for x in over], "overhead_mean_s": round(st.fmean(over), 4),
                  "local_s": local["mean"] and round(local["mean"], 4), "local_se_s": local["se"] and round(local["se"], 4),
                  "local_n": local["n"], "call_s_median": round(st.median(c for l in loops[m] for c in l.calls), 4),
                  "durable_s_max": round(max(c for l in loops[m] for c in l.completion), 3), "first_save": firsts[m]}
    print(m, summary[m], flush=True)
res = {**provenance.stamp(device),  # date, host, device, versions; each method's io_path: its first_save
       "model": {"class": "transformers.GPT2LMHeadModel", "transformers": __import__("transformers").__version__,
                 "params": sum(p.numel() for p in model.parameters()), **shape, "batch": args.batch, "seq": seq},
       "steps": args.steps, "interval": args.interval, "checkpoints_per_loop": ckpts, "repeats": args.repeats,
       "step_s_median_none": round(st.median(s for l in loops["none"] for s in l.steps), 4),
       "summary": summary,
       "raw": {m: [tr._raw(l) for l in ls] for m, ls in loops.items()}}
Path(os.environ.get("OUT", "."), "hf_loop.json").write_text(json.dumps(res, indent=1))
if checkpointer is not None:
    checkpointer.close()
shutil.rmtree(root, ignore_errors=True)
