"""A decoded chunk's segments into their tensors: one torch._foreach_copy_ per chunk (the GPU
backend's `scatter`) against a copy_ per segment (before 4fda5fa), in the same process, turned
each repeat. Warm restores (load_into atomic=True and False, the file in the page cache): the
reader's "scatter" stage and the whole call.

    OUT=dir python bench/probes/scatter_ab.py [--sizes 2GB,small] [--repeats 5]

States: the bench's realistic one at each size (gdsckpt.bench.workload.make_state), and "small":
6,300 fp32 tensors of GPT-2-small blocks' keys, shapes scaled down (restore_setup.py's).
Writes scatter_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.engine.gpu.backend import GpuBackend  # noqa: E402


def per_segment(self, copies) -> None:
    for dst, src in copies:
        self.copy(dst, src)


def small_state() -> dict:
    from restore_setup import SHAPES
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"model.h.{b}.{k}": torch.randn(s, device="cuda", generator=g) for b in range(525) for k, s in SHAPES.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2GB,small")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from gdsckpt.bench.workload import make_state
    out = {"date": time.strftime("%F %T %Z"), "device": torch.cuda.get_device_name(), "states": {}}
    foreach = GpuBackend.scatter
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        for size in args.sizes.split(","):
            state = small_state() if size == "small" else make_state(size, device="cuda")
            p = Path(d) / "s.gdsckpt"
            gdsckpt.save(state, p)
            gdsckpt.load_into(p, state)  # warm: kernels, page cache
            rows = {f"{way}_atomic_{a}": [] for way in ("foreach", "per_segment") for a in (False, True)}
            for rep in range(args.repeats):
                ways = [("foreach", foreach), ("per_segment", per_segment)]
                for way, fn in ways if rep % 2 == 0 else ways[::-1]:
                    GpuBackend.scatter = fn
                    for atomic in (False, True):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        stats = gdsckpt.load_into(p, state, atomic=atomic)
                        torch.cuda.synchronize()
                        rows[f"{way}_atomic_{atomic}"].append({"seconds": time.perf_counter() - t,
                                                               "scatter": stats.stages.get("scatter", 0.0)})
            GpuBackend.scatter = foreach
            summary = {k: {"median_s": statistics.median(r["seconds"] for r in v),
                           "median_scatter_s": statistics.median(r["scatter"] for r in v)} for k, v in rows.items()}
            out["states"][size] = {"tensors": len(state) if size == "small" else None, "summary": summary, "rows": rows}
            print(size, json.dumps(summary), flush=True)
            del state
            torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "scatter_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
