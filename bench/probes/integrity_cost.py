"""What issue 12's guarantees cost (README, "What gdsckpt guarantees"):

- flatten: the save-time walk with shared-tensor detection, per tensor, on a 2,000-tensor state;
- load_into(atomic=True) against the default streaming load_into: the extra checksum pass;
- load(trusted=False) against load(): the child process that decodes first.

Loads are cold (page cache dropped before each; no effect on tmpfs) unless --warm; each figure is
the median of --loops. On the CPU the trusted=False rule is applied to zstd chunks too (the CPU
backend alone never needs a child), so that the child's cost is measured where there is no GPU.

    python bench/probes/integrity_cost.py [--device cpu|cuda] [--mb 512] [--loops 3] [--dir DIR] [--out FILE]

Backs: docs/guarantees.md and README "What gdsckpt guarantees": what load_into(atomic=True) and
load(trusted=False) cost (bench/results/: 2026-11-23-h100-integrity/, 2026-11-23-cpu-integrity/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt.reading import isolated
from gdsckpt.format import tree
from gdsckpt.bench.disk import drop_page_cache


def _state(mb: int, device: str) -> dict:
    """A training-like state of `mb` MB: bf16 weights, fp32 master copies and one moment."""
    g = torch.Generator().manual_seed(0)
    n = (mb << 20) // 10 // 64
    out = {"model": {}, "master": {}, "exp_avg": {}}
    for i in range(64):
        w = torch.randn(n, generator=g) * 0.02
        out["model"][f"w{i}"] = w.to(torch.bfloat16).to(device)
        out["master"][f"w{i}"] = w.to(device)
        out["exp_avg"][f"w{i}"] = (w * 1e-3).to(device)
    return out


def _time(fn, loops: int, path: Path, warm: bool) -> float:
    runs = []
    for _ in range(loops):
        if not warm:
            drop_page_cache(path)
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": args.device,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "gdsckpt": gdsckpt.__version__, "cold": not args.warm, "loops": args.loops}

    # flatten: 2,000 small tensors (the walk's cost is per tensor, not per byte)
    many = {f"layer{i}": {"w": torch.randn(8, device=args.device), "b": torch.randn(8, device=args.device)}
            for i in range(1000)}
    tree.flatten(many)
    t = time.perf_counter()
    for _ in range(20):
        tree.flatten(many)
    out["flatten_us_per_tensor"] = (time.perf_counter() - t) / 20 / 2000 * 1e6

    state = _state(args.mb, args.device)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        p = Path(d) / "cost.gdsckpt"
        stats = gdsckpt.save(state, p)
        out.update(logical_bytes=stats.logical_bytes, stored_bytes=stats.stored_bytes, codec=stats.streams[0]["codec"],
                   chunks=stats.chunks, backend=stats.backend, io_path=stats.io_path)
        target = {k: {n: torch.empty_like(v) for n, v in part.items()} for k, part in state.items()}
        out["load_into_s"] = _time(lambda: gdsckpt.load_into(p, target), args.loops, p, args.warm)
        out["load_into_atomic_s"] = _time(lambda: gdsckpt.load_into(p, target, atomic=True), args.loops, p, args.warm)
        out["load_s"] = _time(lambda: gdsckpt.load(p), args.loops, p, args.warm)
        if args.device == "cpu":
            isolated.needs_child = lambda kind, spec, raw: not raw  # the GPU's rule, applied to zstd here
        out["load_untrusted_s"] = _time(lambda: gdsckpt.load(p, trusted=False), args.loops, p, args.warm)
        t = time.perf_counter()
        gdsckpt.open(p).verify(isolated=True)
        out["verify_isolated_s"] = time.perf_counter() - t
    out["atomic_extra"] = out["load_into_atomic_s"] / out["load_into_s"] - 1
    out["untrusted_extra_s"] = out["load_untrusted_s"] - out["load_s"]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
