"""What a device-mode save's copy costs around the call, by where its block comes from (issue 22):
save_async(snapshot="device") copies the state into one block of CUDA's stream-ordered pool
(device_copy.outside_cache) and frees it once the background snapshot has it. With the pool's
release threshold at 0 (CUDA's default) the freed memory goes back to the device at the next
synchronizing call, and the next save maps it again.

    OUT=dir python bench/probes/copy_block_cost.py [--gb 4.9] [--tensors 1172] [--saves 8]

Per save: the copy (snapshot_tensors with the block, complete on return), the block freed from
another thread as the snapshot thread does (no synchronizing call there), then the training thread's next torch.cuda.synchronize
and a 20 ms matmul loop timed after it. Cases: "trim" (threshold 0), "trim-thread" (the same, the freeing thread
synchronizing another stream after the free), "trim-stream" (synchronizing the stream the block
was freed on), "trim-to" (that, then cudaMemPoolTrimTo(0) on the freeing thread), "keep" (threshold above the
block: the memory stays in CUDA's pool between saves), "torch" (copies from torch's cache).
Writes copy_block_cost.json.

Backs: docs/save_async.md and docs/measured.md: where save_async(snapshot="device")'s copy block
comes from, and what a block given back each save costs (~16 ms) (bench/results/:
2026-11-25-h100-device-mode/ (block/)).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gdsckpt.engine.device_copy import outside_cache, side_stream, snapshot_tensors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.9)
    ap.add_argument("--tensors", type=int, default=1172)
    ap.add_argument("--saves", type=int, default=8)
    args = ap.parse_args()
    import cupy
    dev = torch.device("cuda")
    n = int(args.gb * 1e9 / 4 / args.tensors)
    ts = [torch.randn(n, device=dev) for _ in range(args.tensors)]
    a = torch.randn(4096, 4096, device=dev)
    pool = cupy.cuda.runtime.deviceGetDefaultMemPool(0)
    threshold = 4  # cudaMemPoolAttrReleaseThreshold

    def work() -> float:  # a stand-in for training kernels after the call
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%F %T %Z"), "tensors": args.tensors,
           "bytes": sum(t.nbytes for t in ts), "cases": {}}
    snap_side = side_stream("snapshot", dev)  # where snapshot_tensors allocates, copies and frees the block
    cases = ("trim", "trim-thread", "trim-stream", "trim-to", "keep", "torch")
    for case in cases + cases[:4]:
        cupy.cuda.runtime.memPoolSetAttribute(pool, threshold, 0 if case != "keep" else 1 << 62)
        rows = []
        for _ in range(args.saves):
            base = work()
            t0 = time.perf_counter()
            copies = snapshot_tensors(ts, block=None if case == "torch" else outside_cache)
            t1 = time.perf_counter()
            holder = [copies]
            del copies
            other = torch.cuda.Stream()

            def free() -> None:
                time.sleep(0.05)
                holder.clear()
                if case == "trim-thread":  # another stream synchronized on this thread
                    other.synchronize()
                elif case == "trim-stream":  # the stream the block was freed on, synchronized here
                    snap_side.synchronize()
                elif case == "trim-to":  # and the pool trimmed explicitly
                    snap_side.synchronize()
                    cupy.cuda.runtime.memPoolTrimTo(pool, 0)
            th = threading.Thread(target=free)
            th.start()
            th.join()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            after = work()
            rows.append({"copy_s": t1 - t0, "free_thread_s": t2 - t1 - 0.05, "next_sync_s": t3 - t2,
                         "work_after_s": after, "work_before_s": base,
                         "free_bytes": torch.cuda.mem_get_info()[0]})
        key = case if case not in out["cases"] else case + "-again"
        out["cases"][key] = {k: round(st.median(r[k] for r in rows[1:]), 5) for k in rows[0]}
        out["cases"][key]["first_copy_s"] = round(rows[0]["copy_s"], 5)
        print(key, out["cases"][key], flush=True)
        torch.cuda.empty_cache()
    cupy.cuda.runtime.memPoolSetAttribute(pool, threshold, 0)
    Path(os.environ.get("OUT", "."), "copy_block_cost.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
