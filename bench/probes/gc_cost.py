"""Does a save_async cause the training process's full garbage collections? (issue 22: the steps
while a file is written run slower than the 'none' loop's.)

    python bench/probes/gc_cost.py     # CPU, ~1 min: prints the figures

The bench's GPT layout with tiny widths (24 layers: 1,172 tensors with AdamW's state), trained on
the CPU: 400 steps with no checkpoint, then 400 with a save_async every 20 steps (each waited
for), counting generation-2 collections and their seconds through gc.callbacks.
"""

import gc
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import gdsckpt
from gdsckpt.bench import train_methods
from gdsckpt.bench.workload import GPT
from gdsckpt.tree import flatten

torch.manual_seed(0)
model = GPT(24, 4, 64, 256, 64)  # the bench's gpt2-medium depth, tiny widths: its tensor count
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 256, (2, 65))


def step() -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


for _ in range(3):
    step()
state = train_methods.checkpoint_state(model, opt)
print("tensors", len(flatten(state)[1]), "tracked objects", len(gc.get_objects()))
t = time.perf_counter()
gc.collect()
print("one full collection s", round(time.perf_counter() - t, 4))
full: list[float] = []
started: dict = {}


def on_gc(phase, info) -> None:
    if info["generation"] == 2:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            full.append(time.perf_counter() - started["t"])


gc.callbacks.append(on_gc)
d = tempfile.mkdtemp()
for mode in ("none", "save_async"):
    full.clear()
    t = time.perf_counter()
    for i in range(400):
        step()
        if mode != "none" and i % 20 == 19:
            gdsckpt.save_async(train_methods.checkpoint_state(model, opt), os.path.join(d, "c")).result()
    print(mode, "loop s", round(time.perf_counter() - t, 2), "full collections", len(full), "their s", round(sum(full), 3))
