"""Does the Checkpointer's retention delay the next checkpoint's write? (issue 22; session 15 found
an unlink of a 4 GB step taking 1.0 s on the H100 VM's `discard`-mounted ext4, run on the save's
writer thread.) Checkpointer(keep=1).save_async of a --gb GB state every --interval seconds, the
retired step removed either on the writer's thread as before ("inline") or on the Checkpointer's
removal thread ("thread", gdsckpt/removal.py), the two alternated --rounds times.

    OUT=dir python bench/probes/retention_wait.py [--gb 4] [--saves 6] [--interval 2.5] [--rounds 2]

Per save: the call's time (blocked_s), the time its write waited for the writer (queued_s, which
an inline removal of the step before lands in) and from the call to the future's callbacks'
end (done_s: with an inline removal, its own removal too). The state: random fp32 on the GPU
(on the CPU without one). Writes retention_wait.json.
"""
from __future__ import annotations

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

import gdsckpt  # noqa: E402
import gdsckpt.manager as manager  # noqa: E402
from gdsckpt.bench import provenance  # noqa: E402
from gdsckpt.removal import Removals  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--gb", type=float, default=4)
ap.add_argument("--saves", type=int, default=6)
ap.add_argument("--interval", type=float, default=2.5)
ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()


class InlineRemovals(Removals):
    """The retention before gdsckpt/removal.py: the retired step removed on the retiring thread."""

    def submit(self, path):
        self._remove(path)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
state = {f"t{i}": torch.randn(int(args.gb * 1e9) // 4 // 8, device=device) for i in range(8)}
root = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", "/tmp")))
runs = []
for r in range(args.rounds):
    for mode in ("inline", "thread"):
        manager.Removals = InlineRemovals if mode == "inline" else Removals
        d = root / f"{mode}-{r}"
        saves = []
        with gdsckpt.Checkpointer(d, keep=1) as ck:
            ck.save_async(0, state).result()  # the first save: pool pinned, codecs chosen
            for i in range(1, args.saves + 1):
                t0 = time.perf_counter()
                fut = ck.save_async(i, state)
                blocked = time.perf_counter() - t0
                ended = threading.Event()
                fut.add_done_callback(lambda f, e=ended, s=saves, t0=t0: (s.append({"done_s": time.perf_counter() - t0}), e.set()))
                time.sleep(max(0.0, args.interval - (time.perf_counter() - t0)))
                ended.wait()
                stats = fut.result()
                saves[-1].update(blocked_s=blocked, queued_s=stats.queued_s, background_s=stats.background_s,
                                 write_s=stats.write_s, fsync_s=stats.fsync_s, io_path=stats.io_path)
        runs.append({"mode": mode, "round": r, "saves": saves})
        print(mode, r, " ".join(f"q{s['queued_s']:.2f}/d{s['done_s']:.2f}" for s in saves), flush=True)
        manager.Removals = Removals

summary = {}
for mode in ("inline", "thread"):
    later = [s for run in runs if run["mode"] == mode for s in run["saves"][1:]]  # each has one removal before it
    summary[mode] = {k: round(st.median(s[k] for s in later), 3) for k in ("blocked_s", "queued_s", "done_s")}
print(json.dumps(summary))
out = {"probe": "retention_wait", "args": vars(args), "device": device, "state_bytes": sum(t.nbytes for t in state.values()),
       "provenance": provenance.stamp(device), "summary_medians": summary, "runs": runs}
Path(os.environ.get("OUT", "."), "retention_wait.json").write_text(json.dumps(out, indent=1))
