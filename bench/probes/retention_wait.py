"""Does the Checkpointer's retention delay the next checkpoint's write? (issue 22; session 15 found
an unlink of a 4 GB step taking 1.0 s on the H100 VM's `discard`-mounted ext4, run on the save's
writer thread.) Checkpointer(keep=--keep).save_async of a --gb GB state every --interval seconds, its retention
(with keep=1, a full read of the newest step before the older one goes; then the deletion) run
either in the commit's callback on the save's writer thread, as before ("before", 85d03c9's
save_async), or on the Checkpointer's retention thread ("thread", gdsckpt/manager/retention.py),
the two alternated --rounds times.

    OUT=dir python bench/probes/retention_wait.py [--gb 4] [--saves 6] [--interval 4] [--rounds 2] [--keep 2]

Per save: the call's time (blocked_s: it waits for the save before), from the call to the commit
(durable_s), and the save's own stats (its write waited queued_s for the writer, where the
"before" mode's retention after the previous save lands); each retention run's time. The state:
random fp32 on the GPU (on the CPU without one). Writes retention_wait-keepK.json.

Backs: README "Checkpointer": retention runs on its own thread, so a slow unlink does not hold the
next save (call -> commit 5.43 -> 2.12 s) (bench/results/: 2026-11-24-h100-retention/).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
import gdsckpt.manager.checkpointer as manager  # noqa: E402
from gdsckpt.bench import provenance  # noqa: E402
from gdsckpt.manager.retention import RetentionThread  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--gb", type=float, default=4)
ap.add_argument("--saves", type=int, default=6)
ap.add_argument("--interval", type=float, default=4.0)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--keep", type=int, default=2)
args = ap.parse_args()


commits: list[float] = []  # when each save's commit asked for retention
retentions: list[float] = []  # each retention run's seconds


class ThreadRetention(RetentionThread):
    def _run(self):
        t = time.perf_counter()
        super()._run()
        retentions.append(time.perf_counter() - t)

    def request(self):
        commits.append(time.perf_counter())
        super().request()


class BeforeCheckpointer(gdsckpt.Checkpointer):
    """save_async as it was before gdsckpt/manager/retention.py (85d03c9): retention ran in the
    commit's callback, on the save's writer thread, and the next save waited for the future only."""

    def save_async(self, step, state, *, optimizer=None):
        if self._pending is not None:
            Future.exception(self._pending[1])
            self._pending = None
        step = self._check(step)
        fut = self.layout.save_async(step, state, optimizer)
        self._pending = (step, fut, None)

        def done(f):
            if Future.exception(f) is None:
                commits.append(time.perf_counter())
                t = time.perf_counter()
                self._retain()
                retentions.append(time.perf_counter() - t)
        fut.add_done_callback(done)
        return fut


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
state = {f"t{i}": torch.randn(int(args.gb * 1e9) // 4 // 8, device=device) for i in range(8)}
root = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", "/tmp")))
FIELDS = ("snapshot_s", "pool_alloc_s", "pool_wait_s", "queued_s", "background_s", "write_s", "fsync_s")
runs = []
for r in range(args.rounds):
    for mode in ("before", "thread"):
        manager.RetentionThread = ThreadRetention
        make = BeforeCheckpointer if mode == "before" else gdsckpt.Checkpointer
        d = root / f"{mode}-{r}"
        calls, futs = [], []
        with make(d, keep=args.keep) as ck:
            ck.save_async(0, state).result()  # the first save: pool pinned, codecs chosen
            time.sleep(args.interval)  # its retention is not measured
            commits.clear()
            retentions.clear()
            for i in range(1, args.saves + 1):
                t0 = time.perf_counter()
                futs.append(ck.save_async(i, state))
                calls.append((t0, time.perf_counter() - t0))
                time.sleep(max(0.0, args.interval - (time.perf_counter() - t0)))
            ck.wait()
        saves = []
        for (t0, blocked), fut, commit in zip(calls, futs, commits):
            stats = fut.result()
            saves.append({"blocked_s": blocked, "durable_s": commit - t0, "io_path": stats.io_path,
                          **{k: getattr(stats, k) for k in FIELDS}})
        runs.append({"mode": mode, "round": r, "saves": saves, "retention_s": list(retentions)})
        print(mode, r, " ".join(f"b{s['blocked_s']:.2f}/q{s['queued_s']:.2f}/d{s['durable_s']:.2f}" for s in saves),
              flush=True)
        manager.RetentionThread = RetentionThread

summary = {}
for mode in ("before", "thread"):
    later = [s for run in runs if run["mode"] == mode for s in run["saves"]]
    summary[mode] = {k: round(st.median(s[k] for s in later), 3) for k in ("blocked_s", "durable_s", *FIELDS)}
    summary[mode]["retention_s"] = round(st.median(x for run in runs if run["mode"] == mode for x in run["retention_s"]), 3)
print(json.dumps(summary))
out = {"probe": "retention_wait", "args": vars(args), "device": device, "state_bytes": sum(t.nbytes for t in state.values()),
       "provenance": provenance.stamp(device), "summary_medians": summary, "runs": runs}
Path(os.environ.get("OUT", "."), f"retention_wait-keep{args.keep}.json").write_text(json.dumps(out, indent=1))
