"""The check a memory-tier restore makes under torch.distributed before any rank's state is written
(memory_steps.MemorySteps.load): every chunk's checksum of this rank's copy. `Checkpoint.check`
(the read's backend: the GPU's CRC kernel for nvCOMP chunks) against `Checkpoint.verify` (one
core's CRC on the CPU: what that restore ran from 89e69b4 to 2026-11-28), on a memory copy and on
the cold file.

    OUT=dir python bench/probes/check_rate.py [--size 4GB] [--repeats 3]

State: the bench's realistic one (gdsckpt.bench.workload.make_state), saved once with
gdsckpt.save; the memory copy is the file's bytes in a segment under /dev/shm (memory_slot.Slot),
read through memory_source.MemorySource as the tier's restore reads it. Writes check_rate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.bench.disk import drop_page_cache  # noqa: E402
from gdsckpt.bench.workload import make_state  # noqa: E402
from gdsckpt.manager.memory.slot import Slot  # noqa: E402
from gdsckpt.manager.memory.source import MemorySource  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return round(time.perf_counter() - t, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4GB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    p = d / "c.gdsckpt"
    gdsckpt.save(make_state(args.size, device="cuda"), p)
    data = p.read_bytes()
    seg = Path(tempfile.mkdtemp(dir="/dev/shm")) / "seg"
    slot = Slot(seg, len(data))
    slot.write(data, 0)
    del data
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(),
           "size": args.size, "file_bytes": p.stat().st_size, "runs": []}
    with gdsckpt.open(MemorySource(slot, p.stat().st_size, "memory copy")) as ck:
        ck.check()  # warm: the backend's kernels and KvikIO's pool
        for _ in range(args.repeats):
            out["runs"].append({"memory_check_s": timed(ck.check), "memory_verify_cpu_s": timed(ck.verify)})
            print(out["runs"][-1], flush=True)
    for run in out["runs"]:
        drop_page_cache(p)
        with gdsckpt.open(p) as ck:
            run["file_check_cold_s"] = timed(ck.check)
        print(run, flush=True)
    seg.unlink()
    p.unlink()
    Path(os.environ.get("OUT", "."), "check_rate.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
