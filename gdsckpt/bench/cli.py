"""gdsckpt-bench: save/restore throughput, fio-style, and the alternatives side by side.

The report starts with how gdsckpt's save and restore compare with torch.save + fsync and
torch.load of the same state, then the fio-style figures of each job. --train: what each way of
checkpointing costs a training loop (gdsckpt-bench --train --help).
Saves are timed to their durable commit (fsync'd file, rename, fsync'd directory).
Reads are cold unless --warm: the file's page cache is dropped first. Every result names
its device, date, data and I/O path. JSON schema: see SCHEMA below (stable; additions only).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.format import tree
from gdsckpt.core import units
from gdsckpt.engine.backend import gpu_status, set_direct_io
from gdsckpt.core.defaults import RING_DEPTH
from gdsckpt.stats import outer_seconds

from . import provenance, states, train
from .baselines import same_tensors
from .disk import disk_probe, drop_page_cache, mean_probe
from . import options
from .progress import Progress

SCHEMA = 1
SCHEMA_DOC = """
{schema: 1, date, host, device: {kind: gpu|cpu, name}, versions: {gdsckpt, torch, nvcomp, kvikio, python},
 data: {kind: realistic|random|zeros|file, description, logical_bytes, by_dtype: {dtype: bytes}},
 disk: {directory, direct_write_gbps, direct_read_gbps, bytes, probes: [before the jobs, after them]} | null
       (the rates are the two probes' mean),
 jobs: [{name, rw: write|read, target: file|null|null-d2h, bs, iodepth, numjobs, codec, ioengine,
         io_path: gds|compat|cpu, direct, warm, loops, logical_bytes, stored_bytes, ratio, seconds,
         logical_gbps, stored_gbps, iops, lat_ms: {p50, p90, p99, p99.9}, stages: {stage: seconds per loop},
         per_loop_gbps: [logical GB/s of each loop], logical_gbps_mean, logical_gbps_std (over the loops),
         logical_gibps (2^30 bytes a second), cpu: {user_s, sys_s, user_s_per_gb, sys_s_per_gb} (the whole
         process, every thread, over the timed loops; per GB of logical state),
         stage_gbps: {"gather+compress+checksum": GB/s}, setup_s, warmup_s (the untimed first save),
         disk_bound_gbps (file jobs: the disk's O_DIRECT rate / ratio), of_disk_bound (logical_gbps over it),
         (each write loop writes a fresh file: the previous one is deleted and synced first, untimed)
         memory: {ring_gpu_bytes, peak_extra_gpu_bytes, pinned_host_bytes}, streams: [...], verified}],
 compare: [{name, save_s, load_s, save_gbps, load_gbps, stored_bytes, logical_bytes, io_path,
            save_speedup_vs_gdsckpt, load_speedup_vs_gdsckpt, notes}] | null,
 versus_torch: {save_s, load_s (gdsckpt's first save and load job, per loop), torch_save_s, torch_load_s,
                save_x, load_x (torch's seconds over gdsckpt's), sentence} | null (a save and load of a file only)}
"""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def make_data(spec: str, size: str, device: str) -> tuple[dict, dict]:
    from . import workload
    if spec == "default":
        state = workload.make_state(size, device=device)
        where = "" if device.startswith("cuda") else " (emulated on the CPU)"
        kind, desc = "realistic", f"GPT-2-shaped model after AdamW training under bf16 autocast{where}, size {size}"
    elif spec in ("random", "zeros"):
        nbytes = units.parse_size(size) if size not in ("auto", "tiny", "gpt2-small") else (
            500 << 20 if device.startswith("cuda") else 32 << 20)
        state = (workload.random_state if spec == "random" else workload.zeros_state)(nbytes, device)
        kind, desc = spec, f"{spec} tensors" + (" (ZEROS: compress unrealistically well)" if spec == "zeros" else "")
    elif spec.startswith("file:"):
        state = workload.file_state(spec[5:], device)
        kind, desc = "file", spec[5:]
    else:  # options.data_spec refused it already
        raise AssertionError(spec)
    by_dtype: dict[str, int] = {}
    _, leaves = tree.flatten(state)
    for leaf in leaves:
        key = str(leaf.tensor.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + leaf.tensor.nbytes
    return state, {"kind": kind, "description": desc, "logical_bytes": sum(by_dtype.values()), "by_dtype": by_dtype}


def _job_result(name, rw, target, args, bs, depth, stats_list, cpu, verified=None) -> dict:
    """One job's JSON row from its loops' Stats and their CPU times (cpu: [(user s, system s)])."""
    logical = sum(s.logical_bytes for s in stats_list)
    stored = sum(s.stored_bytes for s in stats_list)
    secs = sum(s.seconds for s in stats_list)
    lats = [x for s in stats_list for x in s.latencies]
    stages: dict[str, float] = {}
    for s in stats_list:
        for k, v in s.stages.items():
            stages[k] = stages.get(k, 0.0) + v
    mem: dict[str, int] = {}
    for s in stats_list:
        for k, v in s.memory.items():
            mem[k] = max(mem.get(k, 0), v)
    last = stats_list[-1]
    return {"name": name, "rw": rw, "target": target, "bs": last.chunk_bytes or bs, "iodepth": depth,
            "numjobs": args.numjobs, "codec": args.codec, "ioengine": args.ioengine, "io_path": last.io_path,
            "direct": args.direct, "warm": bool(args.warm) if rw == "read" else None, "loops": len(stats_list),
            "logical_bytes": logical, "stored_bytes": stored, "ratio": stored / logical if logical else 1.0,
            "seconds": secs, "logical_gbps": logical / secs / 1e9 if secs else 0.0,
            "stored_gbps": stored / secs / 1e9 if secs else 0.0,
            "iops": sum(s.chunks for s in stats_list) / secs if secs else 0.0,
            "lat_ms": {f"p{q:g}": _pct(lats, q) * 1e3 for q in (50, 90, 99, 99.9)},
            "stages": {k: v / len(stats_list) for k, v in stages.items()}, "memory": mem,
            # Throughput of the GPU-side stages alone, and the per-save set-up outside them
            # (walking the state tree and planning, ~10-30 us per tensor in Python).
            "stage_gbps": {"gather+compress+checksum": logical / sum(stages.get(k, 0.0) for k in
                                                                     ("gather", "compress", "checksum")) / 1e9
                           if rw == "write" and any(stages.get(k) for k in ("gather", "compress")) else None},
            "setup_s": (secs - outer_seconds(stages)) / len(stats_list),
            "streams": last.streams, "verified": verified, "per_loop_gbps": [s.gbps for s in stats_list],
            "logical_gibps": logical / secs / units.GIB if secs else 0.0,
            "logical_gbps_mean": statistics.fmean(s.gbps for s in stats_list),
            "logical_gbps_std": statistics.stdev(s.gbps for s in stats_list) if len(stats_list) > 1 else 0.0,
            # the whole process's CPU time (every thread: codec pool, I/O threads) per GB of logical state
            "cpu": {"user_s": sum(u for u, _ in cpu), "sys_s": sum(y for _, y in cpu),
                    "user_s_per_gb": sum(u for u, _ in cpu) / (logical / 1e9) if logical else 0.0,
                    "sys_s_per_gb": sum(y for _, y in cpu) / (logical / 1e9) if logical else 0.0}}


def _same(a, b) -> bool:
    """Same keys and bit-identical tensors (plain values are compared by the round-trip tests)."""
    la, lb = tree.flatten(a)[1], tree.flatten(b)[1]
    return [x.key for x in la] == [y.key for y in lb] and same_tensors([x.tensor for x in la], [y.tensor for y in lb])


def run_jobs(args, state, directory: Path, device: str, progress) -> list[dict]:
    from .sinks import HostCopySink, NullSink
    backend = {"posix": "cpu", "gds": "gpu", "compat": "gpu", None: None}[args.ioengine]
    io = args.ioengine if args.ioengine in ("gds", "compat") else "auto"
    jobs = []
    for bs, depth in itertools.product(args.bs or [None], args.iodepth or [None]):
        depth = depth or RING_DEPTH
        opts = dict(codec=args.codec, chunk_bytes=bs, ring_depth=depth, io=io, io_threads=args.numjobs,
                    backend=backend)
        label = f"bs={bs or 'default'} iodepth={depth}"
        path = Path(args.filename) if args.filename else directory / "bench.gdsckpt"
        if args.target != "file":
            sink = NullSink() if args.target == "null" else HostCopySink(device)
            api.save_through(state, sink, **opts)  # warm-up: codecs, pinned ring, allocator
            gc.collect()  # the workload builder's garbage, not the first timed loop's
            runs, cpu = [], []
            for i in _loops(args):
                progress(f"{label} write -> {args.target}, loop {i + 1}")
                runs.append(_cpu_timed(cpu, lambda: api.save_through(state, sink, **opts)))
                runs[-1].memory["pinned_host_bytes"] = sink.pinned_bytes
            jobs.append(_job_result(f"write-{args.target} {label}", "write", args.target, args, bs, depth, runs, cpu))
            continue
        # An untimed save first, as a training job's first checkpoint: nvCOMP codecs, kernels and
        # memory pools are made once per process, and the timed loops measure the checkpoints after it.
        t = time.perf_counter()
        api.save_through(state, NullSink(), **opts)
        warmup_s = time.perf_counter() - t
        gc.collect()
        if args.rw in ("write", "rw"):
            runs, cpu = [], []
            for i in _loops(args):
                progress(f"{label} write {path.name}, loop {i + 1}")
                _free(path)
                runs.append(_cpu_timed(cpu, lambda: gdsckpt.save(state, path, **opts)))
            jobs.append(_job_result(f"write {label}", "write", "file", args, bs, depth, runs, cpu)
                        | {"warmup_s": warmup_s})
        if args.rw in ("read", "rw"):
            runs, cpu, verified = [], [], None
            for i in _loops(args):
                progress(f"{label} read {path.name} ({'warm' if args.warm else 'cold'}), loop {i + 1}")
                if not args.warm:
                    drop_page_cache(path)
                ck = gdsckpt.open(path, ring_depth=depth, io=io, io_threads=args.numjobs, backend=backend)
                out = _cpu_timed(cpu, lambda: _load(ck, device))
                runs.append(ck.last_stats)
                if verified is None and args.rw == "rw":
                    verified = _same(out, state)
                del out
            jobs.append(_job_result(f"read {label}", "read", "file", args, bs, depth, runs, cpu, verified))
    progress.done()
    return jobs


def _free(path: Path) -> None:
    """Delete the previous loop's file and let the file system free its blocks, untimed. A training
    job frees an old checkpoint minutes before it writes the next one; back-to-back loops that
    replaced it would time that freeing (~1 s for 3.6 GB on the H100 host) inside the next save."""
    if path.exists():
        path.unlink()
        os.sync()


def _loops(args):
    """Loop numbers, as fio counts them: --loops N; with --runtime S, no loop starts once S
    seconds have passed (at least one runs); with --time_based too, loops repeat until then."""
    t0 = time.perf_counter()
    i = 0
    while True:
        elapsed = time.perf_counter() - t0
        if i and args.runtime and elapsed >= args.runtime:
            return
        if i >= args.loops and not args.time_based:
            return
        yield i
        i += 1


def _cpu_timed(cpu: list, fn):
    """fn(), with the process's user and system CPU seconds during it appended to `cpu`."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu.append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))
    return out


def _load(ck, device: str):
    out = ck.load(device=device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def run_compare(args, state, directory: Path, device: str, progress) -> list[dict]:
    from . import baselines
    rows = []
    for name, fn in baselines.BASELINES.items():
        progress(f"compare: {name}")
        try:
            rows.append(fn(state, str(directory), device))
        except Exception as e:  # a missing optional library is reported, not fatal
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
    gpu = device.startswith("cuda")
    variants = [("gdsckpt (default)", {}), ("gdsckpt (fastest: raw, no compression)", {"codec": "raw"})]
    for name, opts in variants:
        progress(f"compare: {name}")
        path = directory / "compare.gdsckpt"
        s = gdsckpt.save(state, path, **opts)
        drop_page_cache(path)
        ck = gdsckpt.open(path)
        out = ck.load(device=device)
        if gpu:
            torch.cuda.synchronize()
        ld = ck.last_stats
        rows.append({"name": name, "save_s": s.seconds, "load_s": ld.seconds, "stored_bytes": s.file_bytes,
                     "logical_bytes": s.logical_bytes, "io_path": s.io_path,
                     "notes": f"codec {opts.get('codec', 'auto')}, bit-exact: {_same(out, state)}"})
        del out
        path.unlink()
    ref = rows[-2]
    for r in rows:
        if "error" in r:
            continue
        r["save_gbps"] = r["logical_bytes"] / r["save_s"] / 1e9
        r["load_gbps"] = r["logical_bytes"] / r["load_s"] / 1e9
        r["save_speedup_vs_gdsckpt"] = r["save_s"] / ref["save_s"]
        r["load_speedup_vs_gdsckpt"] = r["load_s"] / ref["load_s"]
    progress.done()
    return rows


def print_normal(result: dict, out=None) -> None:
    out = out or sys.stdout
    d = result
    if d.get("versus_torch"):
        print(d["versus_torch"]["sentence"] + "\n", file=out)
    print(f"gdsckpt-bench {d['date']}  device: {d['device']['name']}  data: {d['data']['kind']} "
          f"({d['data']['description']}), {units.format_bytes(d['data']['logical_bytes'])}", file=out)
    print("  by dtype: " + ", ".join(f"{k} {units.format_bytes(v)}" for k, v in d["data"]["by_dtype"].items()),
          file=out)
    if d.get("disk"):
        k = d["disk"]
        if "error" in k:
            print(f"  disk probe: {k['error']}", file=out)
        else:
            each = " / ".join(f"{p['direct_write_gbps']:.2f}" for p in k.get("probes", []) if "error" not in p)
            print(f"  disk (O_DIRECT, same run): write {k['direct_write_gbps']:.2f} GB/s, "
                  f"read {k['direct_read_gbps']:.2f} GB/s cold" + (f" (writes before / after: {each})" if each else ""),
                  file=out)
    for j in d["jobs"]:
        print(f"\n{j['name']}: io={j['io_path']} codec={j['codec']} loops={j['loops']}"
              + (f" ({'warm' if j['warm'] else 'cold'})" if j["rw"] == "read" else ""), file=out)
        print(f"  bw: logical {j['logical_gbps']:.2f} GB/s ({j['logical_gibps']:.2f} GiB/s), stored "
              f"{j['stored_gbps']:.2f} GB/s ({j['stored_gbps'] * 1e9 / units.GIB:.2f} GiB/s), "
              f"iops {j['iops']:.0f} chunks/s, ratio {j['ratio']:.3f} (saved {1 - j['ratio']:.1%})", file=out)
        if j["loops"] > 1:
            print(f"  per loop: {j['logical_gbps_mean']:.2f} ± {j['logical_gbps_std']:.2f} GB/s logical "
                  f"(mean ± std of {j['loops']} loops)", file=out)
        print(f"  cpu: user {j['cpu']['user_s_per_gb']:.3f} s/GB, system {j['cpu']['sys_s_per_gb']:.3f} s/GB "
              f"(all threads; {j['cpu']['user_s']:.2f} s + {j['cpu']['sys_s']:.2f} s in all)", file=out)
        lat = j["lat_ms"]
        print(f"  chunk lat (ms): p50={lat['p50']:.2f} p90={lat['p90']:.2f} p99={lat['p99']:.2f} "
              f"p99.9={lat['p99.9']:.2f}", file=out)
        print("  stages (s/loop): " + ", ".join(f"{k} {v:.3f}" for k, v in j["stages"].items()), file=out)
        if j["memory"]:
            print("  memory: " + ", ".join(f"{k} {units.format_bytes(v)}" for k, v in j["memory"].items()), file=out)
        if j.get("disk_bound_gbps"):
            print(f"  vs disk: {j['of_disk_bound']:.0%} of the disk's O_DIRECT rate / ratio "
                  f"({j['disk_bound_gbps']:.2f} GB/s logical)", file=out)
        if j.get("verified") is not None:
            print(f"  restored bit-exact: {j['verified']}", file=out)
    if d.get("compare"):
        print(f"\n{'method':<42}{'save s':>8}{'GB/s':>7}{'load s':>8}{'GB/s':>7}{'stored GB':>10}"
              f"{'save x':>8}{'load x':>8}  io", file=out)
        for r in d["compare"]:
            if "error" in r:
                print(f"{r['name']:<42}  skipped: {r['error']}", file=out)
                continue
            print(f"{r['name']:<42}{r['save_s']:>8.2f}{r['save_gbps']:>7.2f}{r['load_s']:>8.2f}{r['load_gbps']:>7.2f}"
                  f"{r['stored_bytes'] / 1e9:>10.3f}{r['save_speedup_vs_gdsckpt']:>8.2f}"
                  f"{r['load_speedup_vs_gdsckpt']:>8.2f}  {r.get('io_path', '')}", file=out)
        print("  (save x / load x: that method's time over gdsckpt default's; above 1 means gdsckpt is faster)",
              file=out)


def print_terse(result: dict, out=None) -> None:
    """One ';'-separated line per job, the fields options.TERSE_FIELDS names, in that order."""
    out = out or sys.stdout
    for j in result["jobs"]:
        print(";".join(str(x) for x in (
            "gdsckpt", SCHEMA, j["name"], j["rw"], j["target"], j["io_path"], j["codec"], j["bs"], j["iodepth"],
            j["logical_bytes"], j["stored_bytes"], f"{j['logical_gbps']:.4f}", f"{j['stored_gbps']:.4f}",
            f"{j['iops']:.1f}", *(f"{v:.4f}" for v in j["lat_ms"].values()), f"{j['logical_gbps_std']:.4f}",
            f"{j['cpu']['user_s_per_gb']:.4f}", f"{j['cpu']['sys_s_per_gb']:.4f}")), file=out)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = []
    if result.get("compare"):
        panels.append("compare")
    sweep = [j for j in result["jobs"] if j["rw"] == "write"]
    if len(sweep) > 1:
        panels.append("sweep")
    if not panels:
        raise SystemExit("--plot needs --compare or a --bs/--iodepth sweep (comma lists)")
    # constrained layout keeps room for the (wrapped) title and the rotated labels
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], panels):
        if kind == "compare":
            rows = [r for r in result["compare"] if "error" not in r]
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [r["save_gbps"] for r in rows], 0.4, label="save (durable)")
            ax.bar([i + 0.2 for i in x], [r["load_gbps"] for r in rows], 0.4, label="load (cold)")
            ax.set_xticks(list(x), [r["name"] for r in rows], rotation=30, ha="right", fontsize=7)
            ax.set_ylabel("GB/s of logical state")
            ax.legend()
        else:
            for depth in sorted({j["iodepth"] for j in sweep}):
                pts = sorted((j["bs"], j["logical_gbps"]) for j in sweep if j["iodepth"] == depth)
                ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker="o", label=f"iodepth {depth}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("chunk size (MiB)")
            ax.set_ylabel("save GB/s (logical)")
            ax.legend()
    fig.suptitle(plot_title(result, width_in=fig.get_figwidth(), fontsize=8), fontsize=8)
    fig.savefig(path, dpi=120)


def plot_title(result: dict, *, width_in: float, fontsize: float) -> str:
    """The chart's title, wrapped to the figure's width (a character of DejaVu Sans is about 0.6
    of the font size wide), so that a long data description is never cut off."""
    text = (f"gdsckpt-bench {result['date']} on {result['device']['name']}: {result['data']['description']}, "
            f"{units.format_bytes(result['data']['logical_bytes'])}")
    return textwrap.fill(text, width=max(20, int(width_in * 72 / (fontsize * 0.6) * 0.9)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.train or args.cost:
        return train.main(args)
    device = choose_device(args)
    progress = Progress()
    progress("building the workload state (trained on the first run, then read from a cache)")
    state, data = make_data(args.data, args.size, device)
    if args.ioengine == "posix":
        state = states.to_device(state, "cpu")
    disk, jobs, compare, torch_row = measure(args, state, data, device, progress)
    report(args, {"schema": SCHEMA, **provenance.stamp(device), "data": data,
                  "disk": disk, "jobs": jobs, "compare": compare, "versus_torch": versus_torch(jobs, torch_row),
                  "args": vars(args)})
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, every argument checked (options.py) before anything runs: a bad one is
    a usage error (exit 2) naming it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--train" in argv and ("-h" in argv or "--help" in argv):
        train.parser().parse_args(["--help"])  # --train's own options, and exits
    ap = argparse.ArgumentParser(prog="gdsckpt-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=SCHEMA_DOC + options.TERSE_DOC)
    options.add_arguments(ap)
    train.add_arguments(ap)  # --train and --cost: train.py and cost.py
    args = ap.parse_args(argv)
    options.check(args, ap)
    return args


def choose_device(args) -> str:
    """The device to measure on (--device, else CUDA where usable); applies --direct to KvikIO."""
    gpu_ok, why = gpu_status()
    device = args.device or ("cuda" if gpu_ok else "cpu")
    if device.startswith("cuda") and not gpu_ok:
        raise SystemExit(f"--device cuda: {why}")
    if args.ioengine == "posix" and device.startswith("cuda"):
        print("note: --ioengine posix runs the CPU path; the state is saved from host memory", file=sys.stderr)
    if args.direct is not None:  # gdsckpt then leaves KvikIO's O_DIRECT as set here
        set_direct_io(bool(args.direct))
    return device


def measure(args, state, data: dict, device: str, progress) -> tuple:
    """(disk probe, jobs, compare rows, torch.save's row): the jobs between two probes of the disk
    they write to, each file job set against the disk's rate, then the compare table (else, for a
    save and load job, torch.save + fsync and torch.load alone)."""
    tmp = None
    directory = Path(args.directory) if args.directory else Path(tmp := tempfile.mkdtemp(prefix="gdsckpt-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        disk = None
        if args.target == "file" and not args.no_disk_probe:
            progress("probing the disk with O_DIRECT")
            disk = disk_probe(directory, min(data["logical_bytes"], 4 << 30))
        jobs = run_jobs(args, state, directory, device, progress)
        if disk is not None and "error" not in disk:  # the disk's weather changes: probe it again after
            progress("probing the disk with O_DIRECT again")
            disk = mean_probe([disk, disk_probe(directory, disk["bytes"])])
            _against_disk(jobs, disk)
        compare = run_compare(args, state, directory, device, progress) if args.compare else None
        torch_row = next((r for r in compare or [] if r["name"].startswith("torch.save")), None)
        if torch_row is None and args.target == "file" and args.rw == "rw":
            from .baselines import torch_save
            progress("torch.save + fsync and torch.load of the same state, for the comparison")
            torch_row = torch_save(state, str(directory), device)
    finally:
        progress.done()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return disk, jobs, compare, torch_row


def versus_torch(jobs: list[dict], torch_row: dict | None) -> dict | None:
    """gdsckpt's first save and load jobs against torch.save + fsync and a torch.load of the same
    state (each timed the same way: to durable, and from a cold page cache unless --warm): the
    factors and the report's first sentence. None where the run has no such pair."""
    save = next((j for j in jobs if j["rw"] == "write" and j["target"] == "file"), None)
    load = next((j for j in jobs if j["rw"] == "read"), None)
    if torch_row is None or "error" in torch_row or save is None or load is None:
        return None
    ours = {"save_s": save["seconds"] / save["loops"], "load_s": load["seconds"] / load["loops"]}
    save_x, load_x = torch_row["save_s"] / ours["save_s"], torch_row["load_s"] / ours["load_s"]

    def how(x: float) -> str:
        return f"{x:.1f}x faster than" if x >= 1 else f"{1 / x:.1f}x slower than"
    reads = "from the page cache" if load["warm"] else "cold reads"
    sentence = (f"gdsckpt saved the {units.format_bytes(save['logical_bytes'] / save['loops'])} state "
                f"{how(save_x)} torch.save + fsync ({ours['save_s']:.3f} s against {torch_row['save_s']:.3f} s) "
                f"and restored it {how(load_x)} torch.load ({ours['load_s']:.3f} s against "
                f"{torch_row['load_s']:.3f} s, {reads}).")
    return {**ours, "torch_save_s": torch_row["save_s"], "torch_load_s": torch_row["load_s"],
            "save_x": save_x, "load_x": load_x, "sentence": sentence}


def _against_disk(jobs: list[dict], disk: dict) -> None:
    """Each file job's bound: the disk's O_DIRECT rate over the stored fraction, and its share of it."""
    for j in jobs:
        if j["target"] == "file":
            rate = disk["direct_write_gbps" if j["rw"] == "write" else "direct_read_gbps"]
            j["disk_bound_gbps"] = rate / j["ratio"]
            j["of_disk_bound"] = j["logical_gbps"] / j["disk_bound_gbps"]


def report(args, result: dict) -> None:
    """The result as --output, --output-format and --plot ask."""
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    if args.output_format == "json":
        json.dump(result, sys.stdout, indent=1)
        print()
    elif args.output_format == "terse":
        print_terse(result)
    else:
        print_normal(result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    sys.exit(main())
