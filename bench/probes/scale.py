"""Issue 22's scale target: save, save_async and restore growing states up to 40+ GB, and one
save_async whose pool is capped below the stored size (back-pressure), on one large GPU.

    OUT=dir python bench/probes/scale.py [--sizes 5GB,10GB,20GB,40GB] [--cap 8GB]

State: gdsckpt.bench.workload.make_state(size) on the GPU (the trained GPT-2-small state, its
blocks copied with noise up to the size: real AdamW moments, bf16 weights, fp32 masters). Per
size, each timed to its fsync'd commit or, for loads, from a dropped page cache (cold):
  save           gdsckpt.save
  reserve        gdsckpt.reserve(state, wait=True): the pool pinned ahead (outside the saves)
  save_async     blocked (the call) and durable (the future's result)
  load           gdsckpt.load_into(atomic=False), then atomic=True (every chunk checked first)
and at the largest size save_async(pool_bytes=--cap). The linear fit of seconds against stored
bytes says whether the cost grows linearly. Writes scale.json.

Backs: README "Measured" (issue 22's scale target) and docs/measured.md: on one H200, 5-40 GB
states save, save_async and restore linearly in stored bytes (r^2 >= 0.985), and an 8 GB pool
under 32.7 GB stored runs (bench/results/: 2026-11-24-h200-scale/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.writing.async_save import release_pools  # noqa: E402
from gdsckpt.bench.disk import disk_probe, drop_page_cache  # noqa: E402
from gdsckpt.bench.workload import make_state  # noqa: E402
from gdsckpt.format.tree import flatten  # noqa: E402
from gdsckpt.core.units import parse_size  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    a = my - b * mx
    ss = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    st = sum((y - my) ** 2 for y in ys) or 1e-12
    return {"intercept_s": round(a, 3), "s_per_gb": round(b * 1e9, 4), "r2": round(1 - ss / st, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5GB,10GB,20GB,40GB")
    ap.add_argument("--cap", default="8GB")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "rows": []}
    sizes = args.sizes.split(",")
    for size in sizes:
        state = make_state(size, device="cuda")
        logical = sum(leaf.tensor.nbytes for leaf in flatten(state)[1])
        p = d / "ckpt.gdsckpt"
        row = {"size": size, "logical_bytes": logical}
        stats, row["save_s"] = timed(lambda: gdsckpt.save(state, p))
        row["stored_bytes"], row["io_path"] = p.stat().st_size, stats.io_path
        if hasattr(gdsckpt, "reserve"):
            res, row["reserve_s"] = timed(lambda: gdsckpt.reserve(state, wait=True).result())
        p.unlink()  # one file at a time: a 40 GB state's file and its replacement's temporary do not fit twice
        t = time.perf_counter()
        fut = gdsckpt.save_async(state, p)
        row["save_async_blocked_s"] = time.perf_counter() - t
        s = fut.result()
        row["save_async_durable_s"] = time.perf_counter() - t
        row["save_async_pool_alloc_s"] = s.pool_alloc_s
        for atomic in (False, True):
            drop_page_cache(p)
            _, row[f"load_atomic_{atomic}_s"] = timed(lambda: gdsckpt.load_into(p, state, atomic=atomic))
        if size == sizes[-1]:
            cap = parse_size(args.cap)
            release_pools()
            p.unlink()
            t = time.perf_counter()
            fut = gdsckpt.save_async(state, p, pool_bytes=cap)
            blocked = time.perf_counter() - t
            s = fut.result()
            row["capped"] = {"pool_bytes": cap, "blocked_s": blocked, "durable_s": time.perf_counter() - t,
                             "pool_waits": s.pool_waits, "pool_wait_s": s.pool_wait_s, "pool_peak_bytes": s.pool_peak_bytes}
            drop_page_cache(p)
            with gdsckpt.open(p) as ck:  # the capped file is a complete checkpoint: every chunk checked
                ck.verify()
            row["capped"]["verified"] = True
        row["disk"] = disk_probe(d, min(row["stored_bytes"], 8 << 30))
        p.unlink()
        for k in ("save_s", "save_async_durable_s", "load_atomic_False_s", "load_atomic_True_s"):
            row[k + "_gbps"] = round(row["stored_bytes"] / row[k] / 1e9, 3)  # stored GB/s
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        del state
        gc.collect()
        release_pools()
        torch.cuda.empty_cache()
    xs = [r["stored_bytes"] for r in out["rows"]]
    out["linear"] = {k: fit(xs, [r[k] for r in out["rows"]])
                     for k in ("save_s", "save_async_blocked_s", "save_async_durable_s", "load_atomic_False_s",
                               "load_atomic_True_s")}
    print(json.dumps(out["linear"]), flush=True)
    Path(os.environ.get("OUT", "."), "scale.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
