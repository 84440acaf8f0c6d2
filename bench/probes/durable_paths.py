"""Issue 22's disk bound: a durable save against an O_DIRECT write of the same bytes, and a cold
restore against a multi-threaded O_DIRECT read of the same file, through each write path.

    OUT=dir python bench/probes/durable_paths.py [--size 6GB] [--loops 2] [--dir DIR]

State: the bench's realistic one (gdsckpt.bench.workload.make_state: GPT-shaped, AdamW moments
after real training steps, bf16 weights), on the GPU. Paths, each timed from the call to the
fsync'd rename (the file's stored bytes over that time is its rate):
  save            gdsckpt.save (KvikIO: compat here, GDS where nvidia-fs is)
  save-16t        gdsckpt.save with 16 KvikIO threads (default 4)
  pool-1GiB       save_async(pool_bytes=1 GiB).result(): D2H into a pinned pool, our O_DIRECT writer
  pool-state      save_async().result() with the default pool (the stored size)
Per file: the raw O_DIRECT write of its stored byte count (sequential 64 MiB blocks, fsync'd, as
gdsckpt-bench's disk probe), and cold reads of the first path's file, each loop in turn:
O_DIRECT reads of the whole file by 1, 4 and 8 threads, KvikIO reading it whole into one device
buffer with gdsckpt's settings (`--kvikio-read`), and gdsckpt.load_into (atomic=False, its
stages and where the rest of its time went: `Phases`; atomic=True unless `--no-atomic`). Each path's file is deleted once timed (but the one
read), so that a 20 GB state fits the disk. Writes durable_paths.json.

    --paths save,pool-state --size 20GB --loops 3 --kvikio-read --no-atomic --load-options 'ring_depth=4'

`--from-plan` also reads each load_into's way with its reads ahead begun once its plan is made
(gdsckpt before 2026-11-28) instead of at the open, the two in an order turned each loop.
`--read-ahead '0;4x64;4x64p'` also reads the file (load_into, atomic=True too unless --no-atomic) with the read-ahead of
compat mode (gdsckpt/engine/read_ahead.py) at that many threads x MiB blocks instead of the defaults'
(defaults.READ_AHEAD_*), a trailing p: its window pinned; 0 threads: KvikIO reads each record as
the ring asks, as before it.
`--task-sizes 4,128` also reads the file (KvikIO alone with --kvikio-read, and load_into atomic=False)
with KvikIO's task and bounce buffer both that many MiB instead of gdsckpt's (defaults.py
KVIKIO_READ_TASK_BYTES). KvikIO's own, 4 MiB tasks in 16 MiB buffers, read as `4` does: in
compat mode each KvikIO thread reads one task into its bounce buffer and copies it to the GPU
before its next read, so these set how much the disk is asked for at once. The reads' order turns
each loop. `--save-loops N` times N saves per path instead of --loops.

Backs: README "Measured" (the disk bound): durable saves 0.88-1.46x an O_DIRECT write of the same
bytes, cold restores against an 8-thread O_DIRECT read of the file (bench/results/:
2026-11-24-h100-idle/, 2026-11-24-h100-disk20/, 2026-11-24-h100-read-tasks/, 2026-11-25-h100-read-
ahead/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gdsckpt  # noqa: E402
from gdsckpt.bench.disk import disk_probe, drop_page_cache  # noqa: E402
from gdsckpt.bench.workload import make_state  # noqa: E402
from gdsckpt.format.tree import flatten  # noqa: E402

BLOCK = 64 << 20


def direct_read(path: Path, threads: int) -> float:
    """GB/s of O_DIRECT reads of the whole file, `threads` readers of interleaved 64 MiB blocks."""
    import mmap
    size = path.stat().st_size
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, BLOCK) for _ in range(threads)]

    def reader(k: int) -> None:
        for off in range(k * BLOCK, size, threads * BLOCK):
            os.preadv(fd, [bufs[k]], off)
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(reader, range(threads)))
        return size / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


class Phases:
    """Where a load_into's time goes outside its read loop: marks at the Checkpoint's open (the
    footer and index read and parsed), at read_chunks' start and end (the ring's reads, checks
    and decodes: the stats' stages) and at the return; the probe's own wrappers, not the library's."""

    def __init__(self):
        import gdsckpt.reading.reader as reader
        self.marks: dict[str, float] = {}
        opened, chunks = reader.Checkpoint.__init__, reader.read_chunks

        def init(*a, **k):
            opened(*a, **k)
            self.marks["opened"] = time.perf_counter()

        def read(*a, **k):
            self.marks["reads_start"] = time.perf_counter()
            try:
                return chunks(*a, **k)
            finally:
                self.marks["reads_end"] = time.perf_counter()
        reader.Checkpoint.__init__, reader.read_chunks = init, read

    def load(self, path: Path, state, from_open: bool = True, **kw):
        """load_into; from_open=False: its reads ahead start at the plan, as before 2026-11-28, not
        at the open (Checkpoint(read_all=False))."""
        from gdsckpt.reading.reader import Checkpoint
        self.marks.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if from_open:
            stats = gdsckpt.load_into(path, state, **kw)
        else:
            atomic = kw.pop("atomic", False)
            with Checkpoint(path, **kw) as ck:
                stats = ck.load_into(state, atomic=atomic)
        torch.cuda.synchronize()
        end = time.perf_counter()
        m = self.marks
        if "reads_start" not in m:  # a read that went another way (atomic=True's read once into the GPU)
            return end - t0, stats, {"open_s": round(m["opened"] - t0, 3)}
        phases = {"open_s": m["opened"] - t0, "before_reads_s": m["reads_start"] - m["opened"],
                  "reads_s": m["reads_end"] - m["reads_start"], "after_reads_s": end - m["reads_end"]}
        return end - t0, stats, {k: round(v, 3) for k, v in phases.items()}


def task_size(mib: int | None):
    """KvikIO's task and bounce buffer size for what runs inside (gdsckpt's where None): set as a
    user would, in KvikIO's variables too, which gdsckpt then leaves alone."""
    import kvikio
    if not mib:
        return contextlib.nullcontext()
    n = mib << 20
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.dict(os.environ, {"KVIKIO_TASK_SIZE": str(n), "KVIKIO_BOUNCE_BUFFER_SIZE": str(n)}))
    stack.enter_context(kvikio.defaults.set({"task_size": n, "bounce_buffer_size": n}))
    return stack


@contextlib.contextmanager
def read_ahead(threads: int, mib: int | None, pinned: bool):
    """The read-ahead's threads, block size and window (gdsckpt.reading.sources reads them) for what runs inside."""
    import gdsckpt.reading.sources as sources
    with mock.patch.object(sources, "READ_AHEAD_THREADS", threads), \
            mock.patch.object(sources, "READ_AHEAD_PINNED", pinned), \
            mock.patch.object(sources, "READ_AHEAD_BLOCK_BYTES", (mib << 20) if mib else sources.READ_AHEAD_BLOCK_BYTES):
        yield


def kvikio_read(path: Path) -> float:
    """GB/s of KvikIO reading the whole file into one device buffer, with the settings gdsckpt's
    reads use (its thread count, O_DIRECT, compat or GDS): the I/O under load_into, alone."""
    import cupy
    import kvikio

    from gdsckpt.core.defaults import KVIKIO_READ_TASK_BYTES
    from gdsckpt.engine.gpu.io import io_settings
    size = path.stat().st_size
    buf = cupy.empty(size, dtype=cupy.uint8)
    drop_page_cache(path)
    _, settings = io_settings("auto", None, KVIKIO_READ_TASK_BYTES)
    with settings, kvikio.CuFile(path, "r") as f:
        t = time.perf_counter()
        f.pread(buf, size).get()
        s = time.perf_counter() - t
    del buf
    cupy.get_default_memory_pool().free_all_blocks()  # the state's restore needs the room back
    return size / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6GB")
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--save-loops", type=int, help="timed saves per path (default --loops)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--paths", default="save,save-16t,pool-1GiB,pool-state")
    ap.add_argument("--kvikio-read", action="store_true")
    ap.add_argument("--no-atomic", action="store_true")
    ap.add_argument("--from-plan", action="store_true",
                    help="each load_into also with its reads ahead started at the plan, not the open")
    ap.add_argument("--load-options", default="",
                    help="more atomic=False restores, each with these Checkpoint options: "
                         "'ring_depth=4;io_threads=8;ring_depth=4,io_threads=8'")
    ap.add_argument("--read-ahead", default="", help="more reads with the read-ahead at THREADSxMIB: '0;4x64;16x32'")
    ap.add_argument("--task-sizes", default="", help="more reads with KvikIO's task and bounce buffer this many MiB: '16,64'")
    args = ap.parse_args()
    d = Path(args.dir) / "gdsckpt-durable-paths"
    d.mkdir(parents=True, exist_ok=True)
    state = make_state(args.size, device="cuda")
    logical = sum(leaf.tensor.nbytes for leaf in flatten(state)[1])
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "size": args.size,
           "logical_bytes": logical, "directory": str(d), "paths": {}}
    paths = {
        "save": lambda p: gdsckpt.save(state, p),
        "save-16t": lambda p: gdsckpt.save(state, p, io_threads=16),
        "pool-1GiB": lambda p: gdsckpt.save_async(state, p, pool_bytes=1 << 30).result(),
        "pool-state": lambda p: gdsckpt.save_async(state, p).result(),
    }
    names = args.paths.split(",")
    for name in names:
        fn = paths[name]
        p = d / f"{name}.gdsckpt"
        fn(p)  # untimed: first use (pool pinned, codecs made)
        rows = []
        for _ in range(args.loops if args.save_loops is None else args.save_loops):
            torch.cuda.synchronize()
            t = time.perf_counter()
            stats = fn(p)
            s = time.perf_counter() - t
            size = p.stat().st_size
            probe = disk_probe(d, size)
            rows.append({"seconds": round(s, 3), "file_bytes": size, "stored_gbps": round(size / s / 1e9, 3),
                         "direct_write_gbps": round(probe.get("direct_write_gbps", 0), 3),
                         "x_direct": round(size / s / 1e9 / probe["direct_write_gbps"], 3) if "direct_write_gbps" in probe else None,
                         "io_path": getattr(stats, "io_path", None)})
        out["paths"][name] = rows
        print(name, json.dumps(rows), flush=True)
        if name != names[0]:
            p.unlink()
    p = d / f"{names[0]}.gdsckpt"
    size = p.stat().st_size
    reads = {"file": p.name, "file_bytes": size, "loops": []}
    atomics = (False,) if args.no_atomic else (False, True)
    phases = Phases()
    # KvikIO's defaults first, then each --task-sizes, in an order turned by one each loop: the
    # disk drifts within a loop, which would otherwise favour whichever reads first.
    tasks = [None] + [int(m) for m in filter(None, args.task_sizes.split(","))]
    for loop in range(args.loops):
        row = {f"direct_read_{t}t_gbps": round(direct_read(p, t), 3) for t in (1, 4, 8)}
        for mib in tasks[loop % len(tasks):] + tasks[:loop % len(tasks)]:
            tag = f"_task{mib}M" if mib else ""
            with task_size(mib):
                if args.kvikio_read:
                    row[f"kvikio_read{tag}_gbps"] = round(kvikio_read(p), 3)
                starts = (True, False) if mib is None and args.from_plan else (True,)
                starts = starts[loop % len(starts):] + starts[:loop % len(starts)]
                for atomic, from_open in [(a, f) for a in (atomics if mib is None else (False,)) for f in starts]:
                    name = (f"load_into_atomic_{atomic}" if mib is None else f"load_into{tag}") + \
                        ("" if from_open else "_from_plan")
                    drop_page_cache(p)
                    seconds, stats, marks = phases.load(p, state, from_open, atomic=atomic)
                    row[f"{name}_stored_gbps"] = round(size / seconds / 1e9, 3)
                    row[f"{name}_stages"] = {k: round(v, 3) for k, v in stats.stages.items()} | marks
                    row["io_path"] = stats.io_path
        variants = list(filter(None, args.read_ahead.split(";")))
        for ra in variants[loop % len(variants):] + variants[:loop % len(variants)] if variants else ():
            threads, _, mib = ra.rstrip("p").partition("x")
            for atomic in atomics:
                name = f"load_into_ra{ra}" + ("_atomic" if atomic else "")
                with read_ahead(int(threads), int(mib) if mib else None, ra.endswith("p")):
                    drop_page_cache(p)
                    seconds, stats, marks = phases.load(p, state, atomic=atomic)
                row[f"{name}_stored_gbps"] = round(size / seconds / 1e9, 3)
                row[f"{name}_stages"] = {k: round(v, 3) for k, v in stats.stages.items()} | marks
                row[f"{name}_io_path"] = stats.io_path
        for opts in filter(None, args.load_options.split(";")):
            kw = {k: int(v) for k, v in (o.split("=") for o in opts.split(","))}
            drop_page_cache(p)
            seconds, stats, marks = phases.load(p, state, **kw)
            row[f"load_into_{opts}_stored_gbps"] = round(size / seconds / 1e9, 3)
            row[f"load_into_{opts}_stages"] = {k: round(v, 3) for k, v in stats.stages.items()} | marks
        best = max(v for k, v in row.items() if k.startswith("direct_read"))
        row["x_best_direct_read"] = {k: round(v / best, 3) for k, v in row.items() if k.startswith("load_into") and k.endswith("gbps")}
        reads["loops"].append(row)
        print(json.dumps(row), flush=True)
    out["reads"] = reads
    print(json.dumps(reads), flush=True)
    for f in d.iterdir():
        f.unlink()
    Path(os.environ.get("OUT", "."), "durable_paths.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
