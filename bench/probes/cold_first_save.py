"""Issue 22, target 3 on a host whose CuPy kernel cache is cold (a fresh machine or container): the
first save_async after gdsckpt.reserve, against the next one, with reserve's warm-up as it is and
as it was before session 21 (zeros, one tensor per dtype: the gather kernels were left to the first
save, which compiled them in its call).

    OUT=dir python bench/probes/cold_first_save.py [--runs 2] [--warmups old,current] [--profile] [--drop-caches]

Each run is a new process with an empty CUPY_CACHE_DIR, in turn with the old and the current
warm-up: --train's GPT (gpt2-medium) after 3 steps on the GPU, reserve(state, wait=True), then two
save_async calls of its checkpoint state, each waited for. Writes cold_first_save.json: per run,
each call's blocked and durable seconds and its stats (the snapshot's stages, the pool's growth
and waits), the machine's uptime when the process started (a fresh machine's first process is
where --train's first saves missed), and with --profile the call's cProfile, top functions by
cumulative time. --drop-caches (root): the page cache dropped before each process, as on a fresh
machine, whose first process reads the libraries it loads (NVRTC's, for a kernel compiled) from disk.

Backs: docs/measured.md: the first save_async after reserve, on fresh machines and an empty kernel
cache, is 0.007-0.059 s beyond a steady one (bench/results/: 2026-11-25-h100-first-save/,
2026-11-25-h100-unsynced/ (cold/)).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import cProfile, io, json, pstats, sys, tempfile, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench/probes")
import torch
import gdsckpt
from gdsckpt import reserve as reserve_mod
from gdsckpt.bench.train import _first_stats
from gdsckpt.bench.train_methods import checkpoint_state
from gdsckpt.save import Sink, save_flat
from gdsckpt.format.tree import flatten
from idle_trace import warm_loop

def old_warm(planned):  # reserve.warm before session 21
    t = time.perf_counter()
    sample = {str(i): torch.zeros(max(1, reserve_mod.WARM_BYTES // dtype.itemsize), dtype=dtype, device=device)
              for i, (dtype, device) in enumerate(planned.samples.items())}
    skeleton, leaves = flatten(sample)
    save_flat(skeleton, leaves, Sink(reserve_mod._Discard()), planned.options)
    return time.perf_counter() - t

UPTIME = float(open("/proc/uptime").read().split()[0])
if sys.argv[2] == "old":
    reserve_mod.warm = old_warm
model, opt, batches, info = warm_loop("gpt2-medium", 3)
state = checkpoint_state(model, opt)
out = {"warm": sys.argv[2], "uptime_s": UPTIME}
r = gdsckpt.reserve(state, wait=True).result()
out["reserve_s"], out["warm_s"] = r.seconds, r.warm_s
with tempfile.TemporaryDirectory(dir=sys.argv[3]) as d:
    for name in ("first", "second"):
        torch.cuda.synchronize()
        prof = cProfile.Profile() if sys.argv[4] == "1" else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        fut = gdsckpt.save_async(checkpoint_state(model, opt), d + "/" + name)
        if prof:
            prof.disable()
        out[name + "_blocked_s"] = time.perf_counter() - t
        got = fut.result()
        out[name + "_durable_s"], out[name + "_stats"] = got.seconds, _first_stats(got)
        if prof:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
            out[name + "_profile"] = text.getvalue().splitlines()
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2, help="runs of each warm-up, alternating (old first)")
    ap.add_argument("--warmups", default="old,current", help="which warm-ups each run has, in order")
    ap.add_argument("--profile", action="store_true", help="each save_async call under cProfile (slower)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each process (root)")
    args = ap.parse_args()
    out = {"date": time.strftime("%F %T %Z"), "drop_caches": args.drop_caches, "runs": []}
    for i in range(args.runs):
        for kind in args.warmups.split(","):
            with tempfile.TemporaryDirectory() as cache:
                if args.drop_caches:
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("3")
                env = dict(os.environ, CUPY_CACHE_DIR=cache)
                p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), kind, os.environ.get("BENCH_DIR", "/tmp"),
                                    str(int(args.profile))],
                                   env=env, capture_output=True, text=True, timeout=600)
                if p.returncode:
                    print(p.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(p.returncode)
                run = json.loads(p.stdout.strip().splitlines()[-1])
                run["beyond_steady_s"] = run["first_blocked_s"] - run["second_blocked_s"]
                out["runs"].append(run)
                print({k: v for k, v in run.items() if not k.endswith("_profile")}, flush=True)
                for k in ("first_profile", "second_profile"):
                    print("\n".join(run.get(k, [])), flush=True)
    import torch
    out["device"] = torch.cuda.get_device_name()
    (Path(os.environ.get("OUT", ".")) / "cold_first_save.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
