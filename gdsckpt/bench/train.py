"""gdsckpt-bench --train: what checkpointing costs a real training loop.

A GPT-shaped decoder (a plain nn.Module, workload.GPT, no Hugging Face dependency) trains with AdamW
under bf16 autocast (on the CPU: a small model, bf16 emulated as workload.Bf16Matmuls does)
and checkpoints {"model": model.state_dict(), "optim": optimizer state} every --interval steps.
Every method runs the same loop of --steps steps; the last checkpoint's background write is
drained inside the timed loop, so a method's whole cost is in its loop time:

  loop overhead per checkpoint = (loop seconds - the 'none' loop's seconds) / checkpoints

The methods' loops run interleaved (none, A, B, ..., none, A, B, ...) --repeats times, so the
noise between repeats shows. Before its first loop each method makes one checkpoint outside
the loops (codecs, pinned pools, process start-up): reported apart as `first_save`, after what
the method's setup reserved ahead of it (gdsckpt.reserve: `reserve`, with its time).

Per checkpoint: caller-blocked seconds (the call, plus any wait the method imposes before
the next optimizer step: DCP's staging future, a save_async step pre-hook) and background
completion (call to durable). Per loop: peak extra GPU memory over the 'none' loop (torch's
max_memory_allocated, and device-wide free memory from cudaMemGetInfo sampled every step,
which also sees nvCOMP/CuPy/KvikIO allocations), torch's pinned host memory (its caching host
allocator), and the process's peak RSS over its start (pinned pools count there once touched).

Under torchrun (`torchrun --nproc-per-node 2 -m gdsckpt.bench --train ...`) each rank trains
its FSDP2 shard and saves it through DCP (ranks.py); the one-process methods are reported as
unavailable there.

Methods are a table (train_methods.METHODS): one line per method or mode. gdsckpt.save_async
modes are detected from the installed save_async's signature; a mode it does not accept is
reported as unavailable, and a method that raises is recorded with its exception, not fatal.

This module runs it (run_train) and is its command line (add_arguments, main); the parts:
train_methods (the methods), train_loop (the model and one timed loop), train_report (the
result's rows, its JSON shape, the printed table and plot), ranks (torchrun), targets and cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gdsckpt.engine.backend import gpu_status

from . import cost, options, provenance, ranks, states, targets, train_memory, train_report
from .progress import JsonLines, TrainProgress, quiet_dcp_process
from .train_loop import INTERVAL, STEPS, TRAIN_SIZES, Batches, Loop, build, n_checkpoints, run_loop, train_step
from .train_methods import ALIASES, Ctx, NoCheckpoint, select

# What --train compares unless told (--methods): what a user weighs. Under torchrun the
# one-process methods cannot run: dcp.save stands for torch.save there.
DEFAULT_METHODS = "none,torch,dcp-thread,async,dcp-gdsckpt"
DEFAULT_METHODS_RANKS = "none,dcp-sync,dcp-thread,dcp-gdsckpt"
# The CPU's default run: its loops' steps chosen from the warm-up's step time so that the loops
# take about this many seconds together, and the whole run (start-up, first saves) under 3 minutes.
CPU_LOOPS_S = 100


def _clear(directory: Path) -> None:
    for p in directory.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    os.sync()


def plan(args, device: str, step_s: float, loops: int) -> tuple[int, int]:
    """(steps, interval) of every loop: --steps and --interval, the missing one at its default
    (STEPS, INTERVAL); with neither given, on the CPU, as many steps as fit CPU_LOOPS_S at
    `step_s` (the warm-up's, with a margin for the checkpoints), three intervals a loop, an
    interval of 8 to 40 steps, a multiple of 4 x --sync-every."""
    if args.steps is not None or args.interval is not None or device.startswith("cuda"):
        return args.steps or STEPS, args.interval or INTERVAL
    unit = 4 * args.sync_every
    fit = int(CPU_LOOPS_S / (loops * step_s * 1.3) / 3) // unit * unit
    interval = max(unit * -(-8 // unit), min(INTERVAL // unit * unit or unit, fit))
    return 3 * interval, interval


def _timed_warmup(model, opt, batches, device) -> float:
    """Three warm-up steps (AdamW makes its state on the first, kernels compile); the seconds of
    the last two, each."""
    hook, times = [0.0, 0.0], []
    for _ in range(3):
        t = time.perf_counter()
        train_step(model, opt, batches, device, NoCheckpoint(), hook)
        times.append(time.perf_counter() - t)
    return statistics.fmean(times[1:])


def jsonl_path(args) -> str:
    """Where each loop's figures go as they are measured: --jsonl, else beside --output (its name,
    .jsonl), else gdsckpt-bench-train.jsonl in the current directory."""
    if args.jsonl:
        return args.jsonl
    if args.output:
        return str(Path(args.output).with_suffix(".jsonl"))
    return "gdsckpt-bench-train.jsonl"


def run_train(args) -> dict:
    gpu_ok, why = gpu_status()
    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: no CUDA ({why})")
    rk, device = ranks.from_env(args.device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size if args.size in TRAIN_SIZES else ("gpt2-medium" if device.startswith("cuda") else "small-cpu")
    memory = getattr(args, "memory", False)
    replicas = getattr(args, "replicas", 0)
    if replicas and not memory:
        raise SystemExit("--replicas: peer replicas are the memory tier's; add --memory")
    if replicas and not rk:
        raise SystemExit("--replicas: peer replicas need other ranks to hold them; run under torchrun "
                         "(torchrun --nproc-per-node 2 -m gdsckpt.bench --train --memory --replicas 1)")
    default = ("none,async-shards" if rk else "none,async") if memory else DEFAULT_METHODS_RANKS if rk else DEFAULT_METHODS
    methods = select(args.methods or default)
    if memory:  # the memory tier beside them (train_memory.py), at the same interval
        methods += train_memory.methods(args.every_local, replicas)
    for m in methods:  # DLRover's flash checkpoint writes to disk as often as the memory tier does
        if hasattr(m, "every_local"):
            m.every_local = args.every_local
    threads = torch.get_num_threads()
    if not device.startswith("cuda"):
        # One thread trains, as one process drives a GPU: the save's threads get the other cores,
        # as on a GPU host, and a busy machine slows the loop less (two spinning OpenMP threads
        # ran 5-10x slower on the loaded 2-core host).
        torch.set_num_threads(1)
    try:
        with train_memory.node_per_rank(rk, replicas) as nodes:
            for m in methods:
                if getattr(m, "replicas", 0) and nodes:
                    m.node = nodes["node"]
            return _run(args, rk, device, size, methods, memory, gpu_ok)
    finally:
        torch.set_num_threads(threads)


def _run(args, rk, device, size, methods, memory, gpu_ok) -> dict:
    model, opt, windows, minfo = build(size, device)
    if rk:
        opt = ranks.shard(model)
        # every rank its own batches, as data parallel training reads them
        windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(rk.rank))]
    batches = Batches(windows, minfo["batch"], device)
    rows = {m.name: {"name": m.name, "status": "ok", "error": None, "loops": [], "first_save": None,
                     "reserve": None, "notes": ""} for m in methods}
    active = []
    for m in methods:
        why_not = m.available()
        if rk and not m.sharded:
            why_not = "one process's method: under torchrun each rank saves its shards through DCP"
        if why_not:
            rows[m.name].update(status="unavailable", error=why_not)
            continue
        active.append(m)
    warm_step_s = _timed_warmup(model, opt, batches, device)
    if rk:  # one plan for every rank: the slowest rank's
        warm_step_s = max(rk.gather(warm_step_s))
    steps, interval = plan(args, device, warm_step_s, len(active) * args.repeats)
    repeats, sync_every = args.repeats, args.sync_every
    if max(1, interval // 4) % sync_every:  # given ones are checked with the options; a GPU's default is not
        raise SystemExit(f"--sync-every {sync_every}: must divide --interval // 4 ({max(1, interval // 4)}), "
                         "so that every run of steps the estimates sum ends with a sync")
    if rk:
        where, made = rk.shared_directory(args.directory)
        directory, tmp = Path(where), (where if made else None)
    else:
        tmp = None
        directory = Path(args.directory) if args.directory else Path(tmp := tempfile.mkdtemp(prefix="gdsckpt-train-"))
    directory.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(model, opt, directory, device, ranks=rk, dcp_planner=args.dcp_planner)
    state = ctx.state()
    # a plain state: the bytes a save stores; under torchrun: every DTensor at its global size
    state_bytes = states.placed_bytes(state) if rk else states.nbytes(state)
    rank_bytes = states.local_bytes(state) if rk else state_bytes
    n_tensors = sum(1 for v in state["model"].values()) + sum(len(s) for s in state["optim"]["state"].values())
    del state
    rank = rk.rank if rk else None
    log = JsonLines(jsonl_path(args))
    if not rk or rk.rank == 0:
        log.start()
    if rk:  # emptied before any rank writes to it
        rk.barrier()
    progress = TrainProgress(len(active) * repeats, steps, warm_step_s, quiet=bool(rk and rk.rank))
    if not rk or rk.rank == 0:
        progress.note(f"gdsckpt-bench --train: {len(active)} methods x {repeats} repeats of {steps} steps "
                      f"({size}, {state_bytes / 1e6:.1f} MB of state); each loop's "
                      f"figures go to {log.path} as measured")
    log.write({"kind": "run", "rank": rank, "device": device, "model": minfo, "state_bytes": state_bytes,
               "steps": steps, "interval": interval, "repeats": repeats, "sync_every": sync_every,
               "methods": [m.name for m in active]})
    ckpts = n_checkpoints(steps, interval)

    def clear():
        if rk:  # every rank done with the files before rank 0 removes them
            rk.barrier()
        if not rk or rk.rank == 0:
            _clear(directory)
        if rk:
            rk.barrier()

    def failed(m, e, repeat=None):
        rows[m.name].update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        log.write({"kind": "error", "method": m.name, "repeat": repeat, "rank": rank, "error": rows[m.name]["error"]})

    restore = None
    interrupted = False
    try:
        firsts = [m for m in active if m.name != "none"]
        for i, m in enumerate(firsts):  # setup + first save, apart from the loops
            progress.phase(f"first save {i + 1}/{len(firsts)}: {m.name}")
            try:
                m.setup(ctx)
                rows[m.name]["reserve"] = m.reserved
                with quiet_dcp_process() if m.spawns_process else contextlib.nullcontext():
                    tc = time.perf_counter()
                    h = m.save(ctx, ctx.state(), directory / f"first-{len(rows[m.name]['loops'])}")
                    tb = time.perf_counter() - tc
                    got = h.result() if h is not None else None  # the process started: its stderr is set
                m.before_step()
                rows[m.name]["first_save"] = {"blocked_s": tb, "completion_s": time.perf_counter() - tc,
                                              "stats": _first_stats(got)}
                log.write({"kind": "first_save", "method": m.name, "rank": rank, **rows[m.name]["first_save"],
                           "reserve": m.reserved})
            except Exception as e:
                failed(m, e)
            clear()
        for r in range(repeats):
            for m in active:
                if rows[m.name]["status"] != "ok":
                    progress.end_loop()
                    continue
                progress.start_loop(f"{m.name}, repeat {r + 1}/{repeats}")
                ctx.io_path = ctx.stored_bytes = None
                ctx.pinned = 0
                try:
                    loop = run_loop(ctx, m, batches, steps, interval, f"r{r}", sync_every, on_step=progress.step)
                    rows[m.name]["loops"].append(loop)
                    if ctx.stored_bytes:
                        rows[m.name]["stored_bytes"] = ctx.stored_bytes
                    if ctx.io_path:
                        rows[m.name]["io_path"] = ctx.io_path
                    rows[m.name]["_pinned"] = max(rows[m.name].get("_pinned") or 0, ctx.pinned) or None
                    none = rows["none"]["loops"]
                    log.write(train_report.loop_record(m.name, r, rank, loop, none[r] if len(none) > r else None,
                                                       interval, ckpts, ctx.stored_bytes, ctx.io_path))
                except Exception as e:
                    failed(m, e, r)
                progress.end_loop()
                clear()
        if memory and not rk:  # the restores, in a new process, of the trained state
            progress.phase("memory: restore test")
            restore = train_memory.measure_restores(size, device, model, opt, directory, args.memory_remote)
    except KeyboardInterrupt:
        if rk:  # the other ranks are elsewhere: no collective can finish; the lines written stay
            raise
        interrupted = True
        progress.note(f"interrupted: the report covers the loops done; every one measured is in {log.path}")
    finally:
        progress.done()
        for m in active:
            try:
                m.teardown()
            except Exception:
                pass
        if rk and not interrupted:
            rk.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    none_loops: list[Loop] = rows["none"]["loops"]
    none_mean = statistics.fmean(l.seconds for l in none_loops) if none_loops else None
    out_methods = train_report.method_rows(methods, rows, interval, ckpts)
    result = {"schema": train_report.TRAIN_SCHEMA, "mode": "train", **provenance.stamp(device), "gpu_backend": gpu_ok,
              "io_path": next((r.get("io_path") for r in out_methods if r.get("io_path")), None),
              "model": minfo, "state": {"logical_bytes": state_bytes, "tensors": n_tensors},
              "steps": steps, "interval": interval, "checkpoints_per_loop": ckpts, "repeats": repeats,
              "sync_every": sync_every, "warmup_step_s": warm_step_s, "interrupted": interrupted,
              "jsonl": str(log.path), "cpu_threads": None if device.startswith("cuda") else torch.get_num_threads(),
              "dcp_planner": args.dcp_planner,
              "step_s": none_mean / steps if none_mean else None,
              "methods": out_methods, "cost": None}
    if rk:
        result["model"]["sharding"] = f"FSDP2 over {rk.world} ranks"
        result["state"]["per_rank_bytes"] = rank_bytes
        result["world_size"] = rk.world
        per_rank = rk.gather([train_report.rank_row(r) for r in out_methods])
        result["ranks"] = [{"rank": i, "methods": rows_i} for i, rows_i in enumerate(per_rank)]
        result["rank"] = rk.rank
        rk.close()
    result["targets"] = targets.check(result)
    if memory:
        rows_by = {r["name"]: r for r in out_methods}
        result["memory"] = {"loop": rows_by[train_memory.NAME].get("memory"), "restore": restore if not rk else None,
                            "targets": train_memory.idle_target(out_methods)}
        with_replicas = [name for name in rows_by if name.startswith(train_memory.NAME + " replicas=")]
        if with_replicas:  # each rank's replication, by method
            result["memory"]["replicas"] = {
                name: [(next(x for x in rank["methods"] if x["name"] == name).get("memory") or {}).get("replicas")
                       for rank in result["ranks"]] for name in with_replicas}
    return result


def _first_stats(stats) -> dict | None:
    """Where a first save_async's time went (the target 3 check), from its AsyncStats: the snapshot's
    stages, the pool's growth and waits; None for other methods."""
    if not hasattr(stats, "pool_alloc_s"):
        return None
    return {"mode": stats.mode, "snapshot_s": stats.snapshot_s, "stages": dict(stats.stages),
            "pool_alloc_s": stats.pool_alloc_s, "pool_wait_s": stats.pool_wait_s,
            "device_copy_bytes": stats.device_copy_bytes}


def add_arguments(ap) -> None:
    """The --train and --cost options (gdsckpt-bench's own parser; --size, --device,
    --directory, --output, --output-format and --plot are shared)."""
    _add_train(ap)
    cost.add_arguments(ap)


def _add_train(ap) -> None:
    g = ap.add_argument_group("--train: checkpoints inside a training loop")
    g.add_argument("--train", action="store_true", help="measure checkpoints inside a real training loop")
    g.add_argument("--methods", default=None,
                   help="comma list: " + ", ".join(ALIASES) + f", or all (default: {DEFAULT_METHODS}; under "
                        f"torchrun {DEFAULT_METHODS_RANKS})")
    g.add_argument("--steps", type=int, default=None,
                   help=f"training steps per loop (default {STEPS}; on the CPU without --interval: three "
                        f"intervals, about 2 minutes in all)")
    g.add_argument("--interval", type=int, default=None, help=f"a checkpoint every N steps (default {INTERVAL})")
    g.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every method's loop (default 2)")
    g.add_argument("--jsonl", metavar="PATH", default=None,
                   help="each loop's figures, one JSON line per method and repeat (every rank's under torchrun), "
                        "written as measured, so that a stopped run keeps them (default: --output's name with "
                        ".jsonl, else gdsckpt-bench-train.jsonl here)")
    g.add_argument("--sync-every", type=int, default=1, metavar="N",
                   help="the loop reads its loss (loss.item(), the host waiting for the GPU) every N steps; between, "
                        "the host runs ahead (default 1: every step). N must divide --interval // 4")
    g.add_argument("--dcp-planner", choices=["cached", "default"], default="cached",
                   help="the DCP methods' save planner: gdsckpt.dcp.CachedSavePlanner or DCP's default")
    train_memory.add_arguments(g)


def parser():
    """gdsckpt-bench --train's own parser, for --train --help: its options and the shared ones."""
    import argparse
    ap = argparse.ArgumentParser(
        prog="gdsckpt-bench --train",
        description="What each way of checkpointing costs a training loop: a GPT trained with AdamW, checkpointed "
                    "every --interval steps by each method in turn, against the same loop with no checkpoint. "
                    "Prints each method's loop time per checkpoint beyond 'none', the caller's wait and the time "
                    "to durable. Under torchrun (torchrun --nproc-per-node N -m gdsckpt.bench --train) each rank "
                    "trains its FSDP2 shard and saves it through DCP.",
        epilog="--cost prices the result per month (gdsckpt-bench --help lists its options). The fields of "
               "--output's JSON: TRAIN_SCHEMA_DOC in gdsckpt/bench/train_report.py.")
    options.add_shared(ap)
    _add_train(ap)
    return ap


def main(args) -> int:
    if args.train:
        result = run_train(args)
        if result.get("rank", 0) != 0:  # under torchrun rank 0 reports every rank
            return 0
    else:
        if not args.cost_from:
            raise SystemExit("--cost needs --train (this run) or --cost-from RESULT.json")
        result = json.loads(Path(args.cost_from).read_text())
    if args.cost:
        result["cost"] = cost.compute(result, args)
    if args.output and args.train:
        Path(args.output).write_text(json.dumps(result, indent=1))
    elif args.output:
        Path(args.output).write_text(json.dumps(result["cost"], indent=1))
    if args.output_format == "json":
        json.dump(result if args.train else result["cost"], sys.stdout, indent=1)
        print()
    elif args.train:
        train_report.print_train(result)
        if result.get("memory"):
            train_memory.print_memory(result["memory"])
    else:
        cost.print_cost(result["cost"])
    if args.plot and args.train:
        train_report.plot_train(result, args.plot)
    return 0
