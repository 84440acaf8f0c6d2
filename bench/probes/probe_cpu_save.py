"""Interleaved CPU save/load probe (issue 11, item 8): torch.save + fsync against gdsckpt CPU
variants, in one process, round after round, so that load from other processes on a shared
2-core machine hits every method alike. Each save writes a fresh file (the previous one deleted
and synced first, untimed); loads are cold (fsync + POSIX_FADV_DONTNEED first).

    .venv/bin/python bench/probes/probe_cpu_save.py --rounds 5 --out X.json \
        [--variants auto,noshuffle-l1,...] [--size 350MB]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.engine import cpu_backend
from gdsckpt.format import tree
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench import workload
from gdsckpt.bench.disk import drop_page_cache

# name -> (save kwargs, CpuCodecs/HostFile settings)
VARIANTS = {
    "auto": ({}, {}),
    "auto-no-writeback": ({}, {"writeback": False}),
    "auto-buffered": ({}, {"direct": False}),
    "auto-shuffle-then-compress": ({}, {"planes": False}),
    "raw-buffered": ({"codec": "raw"}, {"direct": False}),
    "auto-1-codec-thread": ({}, {"threads": 1}),
    "auto-1-thread-no-writeback": ({}, {"threads": 1, "writeback": False}),
    "auto-no-sampling": ({}, {"min_saving": 0.0}),
    "zstd-l3-plain": ({"codec": "zstd"}, {}),
    "raw": ({"codec": "raw"}, {}),
}


def configure(threads=None, min_saving=None, writeback=True, direct=True, planes=True):
    cpu_backend.CpuCodecs.PLANES = planes
    orig = configure.orig = getattr(configure, "orig", (cpu_backend.CpuCodecs.__init__.__defaults__,
                                                          cpu_backend._SYNC_FILE_RANGE, cpu_backend.CPU_DIRECT_IO))
    cpu_backend.CPU_DIRECT_IO = orig[2] and direct
    d = list(orig[0])
    if threads is not None:
        d[0] = threads
    if min_saving is not None:
        d[1] = min_saving
    cpu_backend.CpuCodecs.__init__.__defaults__ = tuple(d)
    cpu_backend._SYNC_FILE_RANGE = orig[1] if writeback else None


def fresh(path: Path):
    if path.exists():
        path.unlink()
        os.sync()


def leaves(state):
    return [l.tensor for l in tree.flatten(state)[1]]


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x, y.view(torch.uint8) if y.dtype.itemsize == 1 else y)
               for x, y in zip(leaves(a), leaves(b)))


def run_torch(state, d: Path) -> dict:
    p = d / "t.pt"
    fresh(p)
    t0, c0 = time.perf_counter(), time.process_time()
    with open(p, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    save_s, save_cpu = time.perf_counter() - t0, time.process_time() - c0
    drop_page_cache(p)
    t0, c0 = time.perf_counter(), time.process_time()
    out = torch.load(p, map_location="cpu", weights_only=True)
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    r = {"save_s": save_s, "load_s": load_s, "save_cpu_s": save_cpu, "load_cpu_s": load_cpu, "stored_bytes": p.stat().st_size, "exact": same(out, state)}
    del out
    fresh(p)
    return r


def run_gdsckpt(state, d: Path, kwargs, settings) -> dict:
    p = d / "g.gdsckpt"
    fresh(p)
    configure(**settings)
    try:
        c0 = time.process_time()
        s = gdsckpt.save(state, p, **kwargs)
        save_cpu = time.process_time() - c0
        drop_page_cache(p)
        c0 = time.process_time()
        ck = gdsckpt.open(p)
        out = ck.load(device="cpu")
        load_cpu = time.process_time() - c0
        ld = ck.last_stats
        ck.close()
    finally:
        configure()
    r = {"save_s": s.seconds, "load_s": ld.seconds, "save_cpu_s": save_cpu, "load_cpu_s": load_cpu, "stored_bytes": p.stat().st_size, "exact": same(out, state),
         "save_stages": dict(s.stages), "load_stages": dict(ld.stages),
         "streams": [{k: v for k, v in st.items() if k in ("dtype", "ratio", "raw_chunks")} for st in s.streams]}
    del out
    fresh(p)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="350MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--directory")
    ap.add_argument("--out")
    a = ap.parse_args()
    state = workload.make_state(a.size, device="cpu")
    names = ["torch.save"] + a.variants.split(",")
    logical = sum(t.nbytes for t in leaves(state))
    with tempfile.TemporaryDirectory(dir=a.directory) as d:
        d = Path(d)
        api.save_through(state, NullSink())  # warm-up: the codecs, the allocator
        rows = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            for n in order:
                res = run_torch(state, d) if n == "torch.save" else run_gdsckpt(state, d, *VARIANTS[n])
                rows[n].append(res)
                print(f"round {r} {n:22s} save {res['save_s']:.3f} s (cpu {res['save_cpu_s']:.2f})  "
                      f"load {res['load_s']:.3f} s (cpu {res['load_cpu_s']:.2f})  "
                      f"stored {res['stored_bytes'] / 1e6:.1f} MB  exact {res['exact']}  "
                      f"load avg {os.getloadavg()[0]:.1f}", flush=True)
    summary = {}
    for n, rs in rows.items():
        sv, ld = [x["save_s"] for x in rs], [x["load_s"] for x in rs]
        summary[n] = {"save_median_s": statistics.median(sv), "save_min_s": min(sv), "save_max_s": max(sv),
                      "load_median_s": statistics.median(ld), "load_min_s": min(ld), "load_max_s": max(ld),
                      "stored_bytes": rs[-1]["stored_bytes"], "ratio": rs[-1]["stored_bytes"] / logical,
                      "all_exact": all(x["exact"] for x in rs)}
    t = summary["torch.save"]
    print(f"\n{'method':24s} {'save med':>9s} {'min-max':>13s} {'load med':>9s} {'min-max':>13s} {'stored MB':>10s}  save/torch per round")
    for n, s in summary.items():
        per = [x["save_s"] / y["save_s"] for x, y in zip(rows[n], rows["torch.save"])]
        print(f"{n:24s} {s['save_median_s']:9.3f} {s['save_min_s']:6.3f}-{s['save_max_s']:.3f} "
              f"{s['load_median_s']:9.3f} {s['load_min_s']:6.3f}-{s['load_max_s']:.3f} {s['stored_bytes'] / 1e6:10.1f}  "
              + " ".join(f"{p:.2f}" for p in per))
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "gdsckpt": gdsckpt.__version__, "size": a.size, "logical_bytes": logical,
            "rounds": a.rounds, "variants": {n: {"save": VARIANTS[n][0], "settings": VARIANTS[n][1]} for n in names[1:]},
            "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
