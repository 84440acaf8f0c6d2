"""Issue 22, target 4: what a restore spends before its first read, by function. A state of as
many tensors as the 20 GB bench state (~6,300: GPT-2-small blocks' keys and shapes scaled down to
~0.2 GB, so that the reads themselves are short), saved, then load_into cold (the file's pages
evicted first) under cProfile, and timed without it.

    OUT=dir python bench/probes/restore_setup.py [--blocks 525] [--loops 3]

Writes restore_setup.json (the timings) and restore_setup.txt (the profile's top functions).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gdsckpt  # noqa: E402
from gdsckpt.bench.disk import drop_page_cache  # noqa: E402
from gdsckpt.stats import outer_seconds  # noqa: E402

SHAPES = {"attn.c_attn.weight": (768, 96), "attn.c_attn.bias": (96,), "attn.c_proj.weight": (32, 96),
          "attn.c_proj.bias": (32,), "ln_1.weight": (768,), "ln_1.bias": (768,), "ln_2.weight": (768,),
          "ln_2.bias": (768,), "mlp.c_fc.weight": (768, 128), "mlp.c_fc.bias": (128,),
          "mlp.c_proj.weight": (128, 768), "mlp.c_proj.bias": (768,)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=525)
    ap.add_argument("--loops", type=int, default=3)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    state = {f"model.h.{b}.{k}": torch.randn(s, device=dev, generator=g) for b in range(args.blocks)
             for k, s in SHAPES.items()}
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": time.strftime("%F %T %Z"),
           "tensors": len(state), "logical_bytes": sum(t.nbytes for t in state.values()), "loops": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        p = Path(d) / "s.gdsckpt"
        gdsckpt.save(state, p)
        gdsckpt.load_into(p, state)  # warm: the backend, its codecs and kernels, as a restore after saves
        for _ in range(args.loops):
            drop_page_cache(p)
            torch.cuda.synchronize() if dev == "cuda" else None
            t = time.perf_counter()
            ck = gdsckpt.open(p)
            opened = time.perf_counter()
            stats = ck.load_into(state)
            torch.cuda.synchronize() if dev == "cuda" else None
            end = time.perf_counter()
            ck.close()
            out["loops"].append({"open_s": opened - t, "load_into_s": end - opened,
                                 "read_loop_s": outer_seconds(stats.stages), "stages": stats.stages})
            print(out["loops"][-1], flush=True)
        drop_page_cache(p)
        prof = cProfile.Profile()
        prof.enable()
        gdsckpt.load_into(p, state)
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    outdir = Path(os.environ.get("OUT", "."))
    (outdir / "restore_setup.json").write_text(json.dumps(out, indent=1))
    (outdir / "restore_setup.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
