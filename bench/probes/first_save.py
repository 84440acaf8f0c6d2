"""Issue 22, target 3, for a user who never calls reserve: a new process's first save_async, how
long it blocks and how much of that is the host pool's allocation, then a steady save, then
reserve() and the save after it. Ways: `copy` (the library's: a first save that finds the pool
empty copies the state on the GPU and grows the pool on a background thread), `register` (no
copy: the pool's arenas grown in the call, page-locked by cudaHostRegister), `cuda-alloc` (no
copy, arenas from CUDA's own pinned allocator: the earlier way).

    OUT=dir python bench/probes/first_save.py [--size 6GB] [--ways copy,register] [--repeats 2]

Each (way, repeat) runs in a fresh process, alternating ways. State: the bench's realistic one
(gdsckpt.bench.workload.make_state, on the GPU). Writes first_save.json.
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


def child(size: str, way: str, directory: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import gdsckpt
    from gdsckpt.core import defaults
    from gdsckpt.engine import pinned_pool
    from gdsckpt.bench.workload import make_state
    if way != "copy":
        defaults.FIRST_SAVE_COPY_FREE_FRACTION = 0
    if way == "cuda-alloc":
        pinned_pool._registered = lambda size: None  # the fallback: torch.empty(pin_memory=True)
    state = make_state(size, device="cuda")
    torch.cuda.synchronize()
    out = {"way": way}

    def save(name: str) -> dict:
        t = time.perf_counter()
        fut = gdsckpt.save_async(state, Path(directory) / "a.gdsckpt")
        call = time.perf_counter() - t
        s = fut.result()
        return {f"{name}_call_s": call, f"{name}_blocked_s": s.blocked_s, f"{name}_pool_alloc_s": s.pool_alloc_s,
                f"{name}_device_copy_bytes": s.device_copy_bytes, f"{name}_snapshot_s": s.snapshot_s,
                f"{name}_durable_s": time.perf_counter() - t, f"{name}_pool_bytes": s.pool_bytes,
                "stored_bytes": s.file_bytes, "io_path": s.io_path}

    out |= save("first")
    out |= save("steady")
    pinned_pool.release_pools()
    t = time.perf_counter()
    r = gdsckpt.reserve(state, wait=True).result()
    out |= {"reserve_s": time.perf_counter() - t, "reserve_alloc_s": r.alloc_s, "reserve_bytes": r.allocated_bytes}
    out |= save("after_reserve")
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6GB")
    ap.add_argument("--ways", default="copy,register")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("SIZE", "WAY", "DIR"))
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return
    import torch
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        for _ in range(args.repeats):
            for way in args.ways.split(","):
                p = subprocess.run([sys.executable, __file__, "--child", args.size, way, d],
                                   capture_output=True, text=True)
                got = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
                row = json.loads(got[0]) if got else {"way": way, "error": p.stderr[-2000:]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(),
           "size": args.size, "runs": rows}
    Path(os.environ.get("OUT", "."), "first_save.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
