"""A restore from the memory tier in a NEW process (issue 21: <= 0.5 s for the 4.88 GB GPT + AdamW
state on an H100, bit-exact, every chunk checked), broken down, and the ways of moving a memory
copy's bytes onto the GPU that its read path was chosen from. Writes $OUT/memory-restore.json.

    python bench/probes/memory_restore.py [--size gpt2-medium] [--steps 3] [--repeats 2]   # ~5 min on an H100
    python bench/probes/memory_restore.py --size tiny --device cpu --repeats 1   # a smoke test
    python bench/probes/memory_restore.py --only setup,profile   # where a new process's fixed cost goes

This process trains the model a few steps (gdsckpt/bench/train_loop.py), saves the state once
through Checkpointer(memory=True) (a memory copy, and the file), keeps a CRC-64 per tensor, then
runs every measurement in a child process of its own (a restart: CUDA, KvikIO and the mapping
start cold each time):

* restore: Checkpointer(d, memory=True).restore(state) into the state a restarted run holds,
  timed from the Checkpointer's construction (open: lock, commit records, segments mapped) to the
  state filled on the device, with the reader's stages (atomic_read: KvikIO reading every record
  into device memory; atomic_verify: the GPU's checksums; decompress; scatter) and the rest
  (restore_into's planning, load_state_dict). Variants: the KvikIO threads that read the segment
  (memory_source.MemorySource.io_threads: 4, 8, 16; defaults.MEMORY_READ_THREADS is the default),
  and two passes (READ_ONCE_GPU_FRACTION = 0: checking pass, then the decoding one, as when the
  device has no room for the stored bytes). The cold local file, for comparison.
* setup (--only setup): a new process's one-time costs, each timed on its own before the restore:
  importing the GPU modules, cuFile's GDS probe, the backend (stream, codecs object, checksum
  kernels), each checksum kernel's first launch, each codec's first encode and decode of 16 MiB,
  KvikIO's first read of the segment (its thread pool and bounce buffers); then the restore, the
  process now warm. profile: cProfile over a cold restore (its top functions), then a second,
  warm restore in the same process.
* paths: the segment's records to device memory, nothing else: KvikIO compat reads of the shm file
  (4, 8, 16 threads; the first call in a process apart: it allocates the bounce buffers), copies
  from the pageable mapping (what a new process did before), and mmap(MAP_POPULATE) +
  cudaHostRegister + copies from the registered mapping.

Backs: docs/memory.md and docs/measured.md: a new process restores 4.88 GB from the memory tier in
0.41-0.49 s (cold file 2.9-3.6 s); defaults.MEMORY_* read threads (bench/results/:
2026-11-24-h100-memory-restore/, 2026-11-24-h100-fixed-costs/, 2026-11-24-cpu-memory-restore/).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's gdsckpt, installed or not
from gdsckpt.bench.train_memory import digests  # noqa: E402

PIECE = 256 << 20  # copies from host memory go in pieces of a chunk's size


def _state(size: str, device: str, steps: int):
    """The model and AdamW after `steps` real training steps (bf16 autocast on a GPU)."""
    from gdsckpt.bench.train_loop import Batches, build, train_step
    from gdsckpt.bench.train_methods import Method
    model, opt, windows, info = build(size, device)
    batches = Batches(windows, info["batch"], device)
    for _ in range(steps):
        train_step(model, opt, batches, device, Method(), [0.0, 0.0])
    return model, opt, info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- children


def _restarted_state(size: str, device: str):
    """The model and AdamW as a restarted run holds them before its restore: built, one step taken
    (AdamW's state exists), every tensor of the checkpointed state zeroed."""
    from gdsckpt.bench.train_loop import build
    from gdsckpt.bench.train_methods import checkpoint_state
    from gdsckpt.format.tree import flatten
    model, opt, _, _ = build(size, device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state = checkpoint_state(model, opt)
    for leaf in flatten(state)[1]:
        leaf.tensor.zero_()
    _sync(device)
    return model, opt, state


def restore_child(d: Path, size: str, device: str, what: str, threads: int | None, two_pass: bool) -> dict:
    """One restore in this (new) process; what: "memory" or "local_cold"."""
    from gdsckpt import Checkpointer
    from gdsckpt.reading import reader
    from gdsckpt.bench.disk import drop_page_cache
    from gdsckpt.manager.memory.source import MemorySource
    if threads is not None:
        MemorySource.io_threads = threads
    if two_pass:
        reader.READ_ONCE_GPU_FRACTION = 0.0
    _, _, state = _restarted_state(size, device)
    if what == "local_cold":
        for p in d.glob("step_*"):
            drop_page_cache(p)
    _sync(device)
    t0 = time.perf_counter()
    ck = Checkpointer(d, memory=what == "memory")
    t1 = time.perf_counter()
    r = ck.restore(state)
    _sync(device)
    t2 = time.perf_counter()
    ck.close()
    want = json.loads((d / "digests.json").read_text())
    stages = dict(r.stats.stages) if r.stats is not None else {}
    return {"what": what, "threads": threads, "two_pass": two_pass, "source": r.source,
            "bit_exact": digests(state) == want, "seconds": t2 - t0, "open_s": t1 - t0,
            "restore_s": t2 - t1, "read_s": r.stats.seconds if r.stats is not None else None,
            "plan_and_apply_s": (t2 - t1 - r.stats.seconds) if r.stats is not None else None,
            "stages": {k: round(v, 4) for k, v in stages.items()},
            "io_path": r.stats.io_path if r.stats is not None else None,
            "stored_bytes": r.stats.stored_bytes if r.stats is not None else None}


def setup_child(d: Path, size: str, device: str) -> dict:
    """Each one-time cost of a new process's first GPU restore, apart; then the restore itself."""
    import importlib
    from gdsckpt.codecs import spec_for
    from gdsckpt.manager.memory.folders import list_copies
    _, _, state = _restarted_state(size, device)
    times: dict = {}

    def tick(name, fn):
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        times[name] = round(time.perf_counter() - t, 4)
        return r

    tick("import_gpu_modules", lambda: importlib.import_module("gdsckpt.engine.gpu.backend"))
    from gdsckpt.engine.gpu import backend as gb, io as gio, kernels
    from gdsckpt.engine.gpu.codecs import nvcomp_version
    tick("gds_probe", gio.gds_available)
    tick("io_settings", lambda: gio.io_settings("auto", None))
    be = tick("backend", gb.GpuBackend)
    buf = torch.randint(0, 255, (16 << 20,), dtype=torch.uint8, device="cuda")
    for alg in kernels.ALGORITHMS:
        tick(f"checksum_first_{alg}", lambda: be.checksum(buf, alg))
    with be:
        for name, dt, dtype in (("ans", "float32", torch.float32), ("ans", "bfloat16", torch.bfloat16),
                                ("ans-planes", "float32", torch.float32)):
            spec = spec_for(name, dt, nvcomp_version(), "gpu")
            src = torch.randn(4 << 20, device="cuda").to(dtype).view(torch.uint8)[:16 << 20]
            out = be.empty(be.max_stored(spec, src.nbytes))
            scratch = torch.empty_like(src)
            n, frames = tick(f"encode_first_{name}_{dt}", lambda: be.encode(spec, src.clone(), out, scratch))
            back = torch.empty_like(src)
            tick(f"decode_first_{name}_{dt}", lambda: be.decode(spec, out[:n], back, frames))
            assert torch.equal(back, src)
        copy = list_copies(d)[0]
        f = be.open(copy["folder"] / copy["record"]["slot"], "r")
        tick("kvikio_first_read_1MiB", lambda: f.pread(buf, 1 << 20, 0).get())
        f.close()
    t = time.perf_counter()
    r = _restore(d, state, device)
    return {"kind": "setup", "one_time_s": times, "one_time_total_s": round(sum(times.values()), 4),
            "restore_after_setup_s": time.perf_counter() - t, "source": r.source,
            "stages": {k: round(v, 4) for k, v in r.stats.stages.items()}}


def _restore(d: Path, state, device: str):
    from gdsckpt import Checkpointer
    with Checkpointer(d, memory=True) as ck:
        r = ck.restore(state)
    _sync(device)
    return r


def profile_child(d: Path, size: str, device: str) -> dict:
    """cProfile over a cold restore in this new process; then a warm one, timed plainly."""
    import cProfile
    import io
    import pstats
    _, _, state = _restarted_state(size, device)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    _restore(d, state, device)
    prof.disable()
    cold = time.perf_counter() - t
    text, own = io.StringIO(), io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    pstats.Stats(prof, stream=own).sort_stats("tottime").print_stats(30)
    t = time.perf_counter()
    r = _restore(d, state, device)
    warm = time.perf_counter() - t
    return {"kind": "profile", "cold_profiled_s": cold, "warm_s": warm, "warm_source": r.source,
            "warm_stages": {k: round(v, 4) for k, v in r.stats.stages.items()},
            "top_cumulative": text.getvalue().splitlines()[:130],
            "top_tottime": own.getvalue().splitlines()[:60]}


def paths_child(segment: Path, nbytes: int, how: str) -> dict:
    """`nbytes` of `segment` (a memory copy's shm file) into device memory, one way."""
    nbytes -= nbytes % mmap.PAGESIZE  # cudaHostRegister takes whole pages
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.empty(1 << 20, dtype=torch.uint8).pin_memory().cuda()  # CUDA and its host side started
    out = {"how": how, "bytes": nbytes}
    if how.startswith("kvikio"):
        import kvikio
        from gdsckpt.engine.backend import kvikio_settings
        from gdsckpt.engine.gpu.backend import as_cupy
        _, settings = kvikio_settings("compat", int(how.split("-")[1]))  # gdsckpt's own, like for like
        with settings:
            f = kvikio.CuFile(segment, "r")
            try:
                times = []
                for _ in range(3):  # the first call allocates KvikIO's pinned bounce buffers
                    t = time.perf_counter()
                    got = f.pread(as_cupy(dev), nbytes, 0).get()
                    times.append(time.perf_counter() - t)
                    assert got == nbytes, got
            finally:
                f.close()
        out.update(first_s=times[0], warm_s=min(times[1:]))
    elif how == "pageable":
        fd = os.open(segment, os.O_RDWR)
        t = time.perf_counter()
        mm = mmap.mmap(fd, nbytes)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        t_map = time.perf_counter()
        for lo in range(0, nbytes, PIECE):
            dev[lo:lo + PIECE].copy_(host[lo:lo + PIECE])
        torch.cuda.synchronize()
        t_copy = time.perf_counter()
        out.update(map_s=t_map - t, copy_s=t_copy - t_map, first_s=t_copy - t)
        del host
        mm.close()
        os.close(fd)
    elif how == "register":
        from gdsckpt.engine.gpu.host_register import register, unregister
        fd = os.open(segment, os.O_RDWR)
        t = time.perf_counter()
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        t_map = time.perf_counter()
        register(host.data_ptr(), nbytes)
        t_reg = time.perf_counter()
        for lo in range(0, nbytes, PIECE):
            dev[lo:lo + PIECE].copy_(host[lo:lo + PIECE], non_blocking=True)
        torch.cuda.synchronize()
        t_copy = time.perf_counter()
        unregister(host.data_ptr())
        out.update(map_s=t_map - t, register_s=t_reg - t_map, copy_s=t_copy - t_reg, first_s=t_copy - t)
        del host
        mm.close()
        os.close(fd)
    else:
        raise ValueError(how)
    out["gbps"] = nbytes / out["first_s"] / 1e9
    return out


def _child(*args) -> dict:
    cmd = [sys.executable, __file__, "--child", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        return {"args": list(map(str, args)), "error": done.stderr[-4000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="gpt2-medium")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the save")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--directory", default=None, help="where the checkpoint file goes (default: a temporary folder)")
    ap.add_argument("--only", default="restores,paths",
                    help="comma-separated: restores, paths, setup, profile (the last two: GPU only)")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "restore":
            d, size, device, what, threads, two = rest
            r = restore_child(Path(d), size, device, what, None if threads == "-" else int(threads), two == "1")
        elif kind in ("setup", "profile"):
            d, size, device = rest
            r = (setup_child if kind == "setup" else profile_child)(Path(d), size, device)
        else:
            segment, nbytes, how = rest
            r = paths_child(Path(segment), int(nbytes), how)
        print(json.dumps(r))
        return
    from gdsckpt import Checkpointer
    from gdsckpt.bench.provenance import stamp
    from gdsckpt.bench.train_methods import checkpoint_state
    from gdsckpt.core.defaults import MEMORY_READ_THREADS
    from gdsckpt.manager.memory.folders import drop_copies, list_copies
    gpu = a.device.startswith("cuda")
    model, opt, info = _state(a.size, a.device, a.steps)
    base = Path(a.directory) if a.directory else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="gdsckpt-memory-restore-", dir=base))
    result = {**stamp(a.device), "model": info, "steps": a.steps,
              "memory_read_threads_default": MEMORY_READ_THREADS}
    try:
        state = checkpoint_state(model, opt)
        with Checkpointer(d, memory=True) as ck:
            st = ck.save(1, state)
        (d / "digests.json").write_text(json.dumps(digests(state)))
        result["state"] = {"logical_bytes": st.logical_bytes, "stored_bytes": st.stored_bytes, "chunks": st.chunks,
                           "tensors": len(json.loads((d / "digests.json").read_text()))}
        del model, opt, state
        if gpu:
            torch.cuda.empty_cache()
        copy = list_copies(d)[0]
        segment, nbytes = copy["folder"] / copy["record"]["slot"], copy["bytes"]
        print(json.dumps(result["state"]), flush=True)
        variants = [("memory", None, 0)]
        if gpu:
            variants += [("memory", t, 0) for t in (4, 8, 16) if t != MEMORY_READ_THREADS] + [("memory", None, 1)]
        variants.append(("local_cold", None, 0))
        only = set(a.only.split(","))
        rows = []
        for rep in range(a.repeats if "restores" in only else 0):
            for what, threads, two in variants:
                r = _child("restore", d, a.size, a.device, what, "-" if threads is None else threads, two)
                r["repeat"] = rep
                rows.append(r)
                print(json.dumps(r), flush=True)
        result["restores"] = rows
        for kind in ("setup", "profile"):
            if gpu and kind in only:
                result[kind] = [_child(kind, d, a.size, a.device) for _ in range(a.repeats)]
                for r in result[kind]:
                    print(json.dumps(r, indent=1), flush=True)
        if gpu and "paths" in only:
            paths = []
            for rep in range(a.repeats):
                for how in ("kvikio-4", "kvikio-8", "kvikio-16", "pageable", "register"):
                    r = _child("paths", segment, nbytes, how)
                    r["repeat"] = rep
                    paths.append(r)
                    print(json.dumps(r), flush=True)
            result["paths"] = paths
        result["summary"] = _summary(rows)
        print(json.dumps(result["summary"], indent=1), flush=True)
    finally:
        drop_copies(d)
        shutil.rmtree(d, ignore_errors=True)
    out = Path(os.environ.get("OUT", ".")) / "memory-restore.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def _summary(rows: list) -> dict:
    """Median seconds per variant; whether every restore was bit-exact from where it should be."""
    by: dict = {}
    for r in rows:
        if "error" in r:
            continue
        name = r["what"] + (f" threads={r['threads']}" if r["threads"] else "") + (" two-pass" if r["two_pass"] else "")
        by.setdefault(name, []).append(r)
    out = {}
    for name, rs in by.items():
        secs = sorted(r["seconds"] for r in rs)
        out[name] = {"median_s": secs[len(secs) // 2], "min_s": secs[0],
                     "bit_exact": all(r["bit_exact"] for r in rs),
                     "sources": sorted({r["source"] for r in rs})}
    out["errors"] = sum("error" in r for r in rows)
    return out


if __name__ == "__main__":
    main()
