"""Issue 22, target 4: the first restore in a new process, as a resumed run makes it, read ahead
(gdsckpt/engine/read_ahead.py: its pinned window allocated by this restore) against KvikIO's reads (its
bounce buffers allocated by this restore), and each against a second restore in the same process.

    OUT=dir python bench/probes/first_restore.py [--size 6GB] [--runs 3] [--modes ra,kvikio]

The parent saves the bench's realistic state (gdsckpt.bench.workload.make_state) once; each run is
a new process per mode, the modes' order turned each run: it makes empty tensors of the saved
shapes on the GPU, drops the file's pages, and times open + read_into (atomic=False) cold, twice. Modes:
  ra             the defaults: READ_AHEAD_THREADS x READ_AHEAD_BLOCK_BYTES, a window from torch's
                 pinned allocator (cudaHostAlloc)
  kvikio         READ_AHEAD_THREADS = 0: KvikIO reads each record as the ring asks
Writes first_restore.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child(path: str, mode: str) -> dict:
    import torch

    import gdsckpt
    import gdsckpt.reading.sources as sources
    from gdsckpt.bench.disk import drop_page_cache
    from gdsckpt.core.dtypes import BY_NAME
    t0 = time.perf_counter()
    if mode == "kvikio":
        sources.READ_AHEAD_THREADS = 0
    torch.cuda.init()
    with gdsckpt.open(path) as ck:
        state = {t.key: torch.empty(t.shape, dtype=BY_NAME[t.dtype], device="cuda") for t in ck.index.plan.tensors}
    torch.cuda.synchronize()
    out = {"mode": mode, "setup_s": round(time.perf_counter() - t0, 3), "loads": []}
    for _ in range(2):
        drop_page_cache(path)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with gdsckpt.open(path) as ck:
            stats = ck.read_into(state)
        torch.cuda.synchronize()
        s = time.perf_counter() - t
        out["loads"].append({"seconds": round(s, 3), "stored_gbps": round(stats.stored_bytes / s / 1e9, 3),
                             "io_path": stats.io_path, "stages": {k: round(v, 3) for k, v in stats.stages.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6GB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="ra,kvikio")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--child", nargs=2, metavar=("PATH", "MODE"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return
    import torch

    import gdsckpt
    from gdsckpt.bench.workload import make_state
    p = Path(args.dir) / "gdsckpt-first-restore.gdsckpt"
    state = make_state(args.size, device="cuda")
    gdsckpt.save(state, p)
    del state
    torch.cuda.empty_cache()
    modes = args.modes.split(",")
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "size": args.size,
           "file_bytes": p.stat().st_size, "runs": []}
    try:
        for run in range(args.runs):
            for mode in modes[run % len(modes):] + modes[:run % len(modes)]:
                r = subprocess.run([sys.executable, __file__, "--child", str(p), mode], capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"{mode}: {r.stderr[-3000:]}")
                row = json.loads(r.stdout.strip().splitlines()[-1])
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        p.unlink(missing_ok=True)
    Path(os.environ.get("OUT", "."), "first_restore.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
