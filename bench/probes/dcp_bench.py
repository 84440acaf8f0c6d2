"""DCP on N GPUs (default 2): gdsckpt's storage plugin against DCP's FileSystemWriter/Reader,
plain and with its ZStandard stream extension, on the same sharded state in the same run.

    python bench/probes/dcp_bench.py --out dcp.json [--size 8GB] [--dir /tmp/dcp-bench] [--loops 2]

The state: gdsckpt.bench.workload.make_state(--size) (a trained GPT-2-shaped mixed-precision
state: bf16 weights, fp32 master weights, AdamW moments), built on every GPU and sharded over
the ranks as DTensors (Shard(0) of every tensor with a dimension; scalars replicated, so DCP
writes them once); --size is the whole (global) state, each rank holds about 1/N of it.

For each method and loop, every rank:
  save: barrier, dcp.save(state, storage_writer=W) timed until it returns, durable: every
        file fsync'd (gdsckpt: fsync + rename + directory fsync per rank file, then .metadata
        the same way; FileSystemWriter: sync_files=True fsyncs each file and .metadata, and the
        directory is fsync'd here, inside the timed region);
  drop: fsync + posix_fadvise(DONTNEED) on every file of the checkpoint (cold reads);
  load: barrier, dcp.load into preallocated zero shards on the GPU, timed until it returns
        and the GPU is synchronized; then checked bit-exact against the state.
Aggregate GB/s = global logical bytes / (last rank's end - first rank's start); per rank:
the rank's own logical bytes over its dcp.save / dcp.load wall time and over its own
write_data / read_data time (the storage layer alone, without DCP's planning and barriers).
Stored bytes: the files each rank wrote (__{rank}_*), and the whole directory.

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before the ranks start.

Backs: docs/measured.md (2x H200): gdsckpt's DCP plugin saves 1.67 GB/s (3.61 GB stored) against
FileSystemWriter's 0.62 GB/s and its ZStandard extension's 0.46 GB/s; bench/run.sh's `dcp` job
(bench/results/: 2026-11-22-h200x2-dcp/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

from gdsckpt.bench.disk import drop_page_cache
from gdsckpt.core.storage import fsync_dir

ROOT = Path(__file__).resolve().parents[2]  # the repository root
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("gdsckpt", "fs", "fs-zstd")


# ---------------------------------------------------------------- state


def shard_state(full, mesh, rank: int, world: int):
    """Every tensor with a dimension becomes a DTensor, Shard(0) (torch.chunk's split, which is
    DTensor's: ranks past the last chunk hold an empty shard); scalars stay plain tensors."""
    from torch.distributed.tensor import DTensor, Shard

    def conv(o):
        if isinstance(o, torch.Tensor):
            if o.dim() == 0:
                return o.clone()
            pieces = torch.chunk(o, world, dim=0)
            loc = pieces[rank].clone() if rank < len(pieces) else o.new_empty((0, *o.shape[1:]))
            return DTensor.from_local(loc, mesh, [Shard(0)], run_check=False, shape=o.shape, stride=o.stride())
        if isinstance(o, dict):
            return {str(k): conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(conv(v) for v in o)
        return o

    return conv(full)


def leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def zeros_like_state(state):
    from torch.distributed.tensor import DTensor

    def conv(o):
        if isinstance(o, DTensor):
            return DTensor.from_local(torch.zeros_like(o.to_local()), o.device_mesh, o.placements, run_check=False,
                                      shape=o.shape, stride=o.stride())
        if isinstance(o, torch.Tensor):
            return torch.zeros_like(o)
        if isinstance(o, dict):
            return {k: conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(conv(v) for v in o)
        return o

    return conv(state)


def local_bytes(state, rank: int) -> int:
    """This rank's share of the logical bytes: its shards, and replicated tensors on rank 0 only."""
    from torch.distributed.tensor import DTensor
    n = 0
    for _, v in leaves(state):
        if isinstance(v, DTensor):
            n += v.to_local().nbytes
        elif isinstance(v, torch.Tensor) and rank == 0:
            n += v.nbytes
    return n


def same_state(a, b) -> bool:
    ok = True
    for (ka, va), (kb, vb) in zip(leaves(a), leaves(b)):
        if isinstance(va, torch.Tensor):
            x, y = local(va), local(vb)
            ok &= x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))
    return bool(ok)


# ---------------------------------------------------------------- storage


def timed(cls):
    """cls with write_data / read_data timed (the storage layer's own time on this rank)."""

    class Timed(cls):
        io_seconds = 0.0

        def _timed(self, call, plan, planner):
            t = time.perf_counter()
            fut = call(plan, planner)
            fut.wait()
            self.io_seconds = time.perf_counter() - t
            return fut

        def write_data(self, plan, planner):
            return self._timed(super().write_data, plan, planner)

        def read_data(self, plan, planner):
            return self._timed(super().read_data, plan, planner)

    Timed.__name__ = f"Timed{cls.__name__}"
    return Timed


def make_writer(method: str, d: Path, args):
    from torch.distributed.checkpoint import FileSystemWriter
    if method == "gdsckpt":
        from gdsckpt.dcp import GdsckptWriter
        return timed(GdsckptWriter)(d, codec=args.codec)
    if method == "fs":
        return timed(FileSystemWriter)(d, sync_files=True, thread_count=args.fs_threads)
    from torch.distributed.checkpoint._extension import ZStandard
    return timed(FileSystemWriter)(d, sync_files=True, thread_count=args.fs_threads, _extensions=[ZStandard()])


def make_reader(method: str, d: Path):
    from torch.distributed.checkpoint import FileSystemReader
    if method == "gdsckpt":
        from gdsckpt.dcp import GdsckptReader
        return timed(GdsckptReader)(d)
    return timed(FileSystemReader)(d)  # its default extension registry decodes ZStandard streams


def drop_cache(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            drop_page_cache(p)


def rank_files_bytes(d: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.startswith(f"__{rank}_"))


# ---------------------------------------------------------------- one rank


def rank_main(rank: int, world: int, args) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    root = Path(args.dir)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.FileStore(str(root / "store"), world),
                            rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        mesh = init_device_mesh("cuda", (world,))
        from gdsckpt.bench.workload import make_state
        state = None
        for r in range(world):  # one rank at a time: the first trains (or loads the cache), the others load it
            if r == rank:
                t = time.perf_counter()
                full = make_state(args.size, device=f"cuda:{rank}", cache_dir=args.cache_dir)
                state = shard_state(full, mesh, rank, world)
                del full
                torch.cuda.empty_cache()
                print(f"[rank {rank}] state ready in {time.perf_counter() - t:.1f} s", flush=True)
            dist.barrier()
        mine = local_bytes(state, rank)
        n_tensors = sum(isinstance(v, torch.Tensor) for _, v in leaves(state))
        logical = [None] * world
        dist.all_gather_object(logical, mine)
        total = sum(logical)

        methods = [m for m in args.methods.split(",") if m]
        if "fs-zstd" in methods:
            from torch.distributed.checkpoint._extension import ZStandard
            if not ZStandard.is_available():
                if rank == 0:
                    print("fs-zstd skipped: neither zstandard nor pyzstd is installed", flush=True)
                methods.remove("fs-zstd")

        # warm-up: every method once on a small part of the state (CUDA contexts, nvCOMP, KvikIO, threads)
        small = {f"w{i}": v for i, (_, v) in enumerate(
            (kv for kv in leaves(state) if isinstance(kv[1], torch.Tensor) and kv[1].dim())) if i < 4}
        for m in methods:
            d = root / f"warmup-{m}"
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
            dcp.save(small, storage_writer=make_writer(m, d, args))
            dcp.load(zeros_like_state(small), storage_reader=make_reader(m, d))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)

        runs = []
        for loop in range(args.loops):
            for m in methods:
                d = root / f"ckpt-{m}"
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
                target = zeros_like_state(state)
                torch.cuda.synchronize()
                dist.barrier()

                w = make_writer(m, d, args)
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=w)
                if m != "gdsckpt" and rank == 0:
                    fsync_dir(d)  # FileSystemWriter renames .metadata but leaves the directory unsynced
                t1 = time.perf_counter()
                dist.barrier()
                stored_mine = rank_files_bytes(d, rank)
                if rank == 0:
                    drop_cache(d)
                dist.barrier()

                r = make_reader(m, d)
                t2 = time.perf_counter()
                dcp.load(target, storage_reader=r)
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                ok = same_state(target, state)
                del target
                torch.cuda.empty_cache()

                mine_run = {"rank": rank, "save": (t0, t1, w.io_seconds), "load": (t2, t3, r.io_seconds),
                            "stored_bytes": stored_mine, "verified": ok}
                if m == "gdsckpt" and w.last_stats is not None:
                    mine_run["gdsckpt_save"] = {k: v for k, v in w.last_stats.to_dict().items()
                                                if k in ("backend", "io_path", "chunk_bytes", "ring_depth", "chunks",
                                                         "ratio", "stages", "memory", "streams")}
                gathered = [None] * world
                dist.all_gather_object(gathered, mine_run)
                if rank == 0:
                    dir_bytes = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
                    runs.append(summarize(m, loop, gathered, logical, total, dir_bytes))
                    s = runs[-1]
                    print(f"{m:8s} loop {loop}: save {s['save']['gbps']:6.2f} GB/s  load {s['load']['gbps']:6.2f} GB/s"
                          f"  stored {s['stored_bytes'] / 1e9:7.3f} GB (ratio {s['ratio']:.3f})"
                          f"  verified {s['verified']}", flush=True)
                dist.barrier()
                if rank == 0 and not args.keep:
                    shutil.rmtree(d, ignore_errors=True)
                dist.barrier()

        if rank == 0:
            write_json(args, world, logical, total, n_tensors, runs)
    finally:
        dist.destroy_process_group()


def summarize(method, loop, gathered, logical, total, dir_bytes) -> dict:
    out = {"method": method, "loop": loop, "stored_bytes": dir_bytes, "logical_bytes": total,
           "ratio": dir_bytes / total if total else 1.0, "verified": all(g["verified"] for g in gathered)}
    for op in ("save", "load"):
        start = min(g[op][0] for g in gathered)
        end = max(g[op][1] for g in gathered)
        per_rank = []
        for g in gathered:
            t0, t1, io_s = g[op]
            b = logical[g["rank"]]
            per_rank.append({"rank": g["rank"], "logical_bytes": b, "seconds": t1 - t0, "gbps": b / (t1 - t0) / 1e9,
                             "storage_seconds": io_s, "storage_gbps": b / io_s / 1e9 if io_s else None})
        out[op] = {"seconds": end - start, "gbps": total / (end - start) / 1e9, "per_rank": per_rank}
    out["per_rank_stored_bytes"] = [g["stored_bytes"] for g in gathered]
    extra = [g.get("gdsckpt_save") for g in gathered]
    if any(extra):
        out["gdsckpt_save_per_rank"] = extra
    return out


def write_json(args, world, logical, total, n_tensors, runs) -> None:
    import gdsckpt
    versions = {"gdsckpt": gdsckpt.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "cuda": torch.version.cuda}
    try:
        from gdsckpt.engine.gpu.backend import nvcomp_version
        versions["nvcomp"] = nvcomp_version()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        versions["nvcomp"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        import kvikio
        versions["kvikio"] = kvikio.__version__
    except Exception:  # noqa: BLE001
        versions["kvikio"] = None
    summary = {}
    for m in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == m]
        summary[m] = {"save_gbps_best": max(r["save"]["gbps"] for r in rs),
                      "load_gbps_best": max(r["load"]["gbps"] for r in rs),
                      "save_seconds_best": min(r["save"]["seconds"] for r in rs),
                      "load_seconds_best": min(r["load"]["seconds"] for r in rs),
                      "stored_bytes": rs[-1]["stored_bytes"], "ratio": rs[-1]["ratio"],
                      "verified": all(r["verified"] for r in rs)}
    doc = {
        "benchmark": "dcp_bench", "schema": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": {"name": torch.cuda.get_device_name(0), "gpus": world,
                   "names": [torch.cuda.get_device_name(i) for i in range(world)]},
        "versions": versions,
        "args": vars(args),
        "state": {"size": args.size, "logical_bytes": total, "per_rank_logical_bytes": logical, "tensors": n_tensors,
                  "sharding": "DTensor Shard(0) of every tensor with a dimension; scalars replicated"},
        "timing": "saves to durable (fsync'd files and directory); loads cold (page cache dropped), into GPU shards",
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    print(f"wrote {args.out}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--size", default="8GB", help="global state size (make_state: 'gpt2-small', '8GB', ...)")
    ap.add_argument("--dir", default="/tmp/dcp-bench", help="checkpoint directory root (a local disk)")
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--codec", default="auto", help="gdsckpt codec")
    ap.add_argument("--fs-threads", type=int, default=1, help="FileSystemWriter thread_count (DCP's default: 1)")
    ap.add_argument("--cache-dir", default=None, help="workload cache (default $GDSCKPT_CACHE or ~/.cache/gdsckpt)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs, torch sees {torch.cuda.device_count()}")
    for m in args.methods.split(","):
        if m and m not in METHODS:
            sys.exit(f"unknown method {m!r}; choose from {METHODS}")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "store").unlink(missing_ok=True)
    import torch.multiprocessing as mp
    mp.start_processes(rank_main, args=(args.world, args), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
