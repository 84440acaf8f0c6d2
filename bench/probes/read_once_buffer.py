"""Where a GPU restore's buffer of every stored byte (`load_into(atomic=True)` read once into the
GPU, ring.read_verified) comes from, and what it leaves behind: cudaMalloc, freed at the end of
the call (the library's way, gpu/device_block.allocated), against torch's caching allocator
(the way before, which kept the buffer reserved in torch's cache). Each way in turn, `--loops`
times: a cold `load_into(atomic=True)` of the bench's realistic state, its seconds, and torch's
reservation and the device's free memory before and after.

    OUT=dir python bench/probes/read_once_buffer.py [--size 6GB] [--loops 3]

Writes read_once_buffer.json.

Backs: docs/memory.md and docs/measured.md: a restore read once into the GPU gives its buffer back:
torch's reservation grows 0.50 GiB after a 4.94 GB-stored restore, against 5.10 GiB before
(bench/results/: 2026-11-24-h100-read-once/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench.disk import drop_page_cache  # noqa: E402
from gdsckpt.bench.workload import make_state  # noqa: E402
from gdsckpt.engine.gpu.backend import GpuBackend  # noqa: E402

LIBRARY = GpuBackend.empty


def torch_cache(self, nbytes: int, *, once: bool = False) -> torch.Tensor:
    """The way before: every buffer from torch's caching allocator."""
    return LIBRARY(self, nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6GB")
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = ap.parse_args()
    state = make_state(args.size, device="cuda")
    p = Path(args.dir) / "read-once-buffer.gdsckpt"
    gdsckpt.save(state, p)
    gdsckpt.load_into(p, state, atomic=True)  # warm: the backend, its codecs and kernels
    out = {"date": time.strftime("%F %T %Z"), "device": torch.cuda.get_device_name(), "size": args.size,
           "file_bytes": p.stat().st_size, "loops": []}
    gib = 1 << 30
    for loop in range(args.loops):
        for way, empty in (("cudaMalloc", LIBRARY), ("torch-cache", torch_cache)):
            GpuBackend.empty = empty
            torch.cuda.empty_cache()  # each way from the same start: no buffer cached by the other
            torch.cuda.synchronize()
            reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
            drop_page_cache(p)
            t = time.perf_counter()
            stats = gdsckpt.load_into(p, state, atomic=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            row = {"loop": loop, "way": way, "seconds": round(seconds, 3),
                   "read_once": "atomic_read" in stats.stages, "io_path": stats.io_path,
                   "reserved_grew_gib": round((torch.cuda.memory_reserved() - reserved) / gib, 3),
                   "free_fell_gib": round((free - torch.cuda.mem_get_info()[0]) / gib, 3)}
            out["loops"].append(row)
            print(json.dumps(row), flush=True)
    GpuBackend.empty = LIBRARY
    p.unlink()
    Path(os.environ.get("OUT", "."), "read_once_buffer.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
