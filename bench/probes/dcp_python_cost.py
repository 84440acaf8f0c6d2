"""What dcp.async_save + GdsckptWriter costs the training process in Python, per steady save
(issue 22, target 2), measured on any machine (the CPU is enough: the cost is per tensor).

The state is the bench's GPT (gdsckpt.bench.workload.GPT, --layers/--d/--vocab; 24 layers give
the 406M GPT's 293 parameters, so model + AdamW state = 1,172 tensors) after one AdamW step, as
gdsckpt-bench --train checkpoints it (train_methods.checkpoint_state), in one gloo process
group of one rank. Each save, as the bench's "dcp.async_save GdsckptWriter" does it: a new
GdsckptWriter and a new CachedSavePlanner (one cache_key) per save, a new directory per save.
The same state through gdsckpt.save_async (no DCP) is the floor.

Per save (the first --warmup dropped):
  call_s:      wall seconds inside the call (dcp.async_save / save_async): the caller blocked
  call_cpu_s:  the calling thread's CPU seconds in the call
  bg_cpu_s:    CPU seconds of DCP's background thread (its whole save(): planning, write_data,
               the collectives, finish): Python work there holds the GIL the training needs
  bg_wall_s:   its wall seconds
  done_s:      call to durable
  late_s:      a ticker thread sleeping 1 ms in a loop: its lateness from the call's end to the
               save's end, beyond its idle lateness: the GIL others held while it wanted it
  gc:          seconds in the cyclic garbage collector, per thread role and generation
  spans:       thread CPU seconds inside named functions (planner, writer, DCP's collectives,
               our staging and metadata), per thread role ("caller" or "background");
               functions that do not exist in the tree measured are skipped; each span adds
               its own timing (~2-4 us a call), so per-tensor ones only with --item-spans
and --profile: cProfile of one steady save's caller and background thread (by own time),
printed and kept in the JSON. Writes $OUT/dcp_python_cost.json (or --out).

Run from the repository root (so that this tree's gdsckpt is the one imported):
  PYTHONPATH=. python bench/probes/dcp_python_cost.py [--layers 24 --d 64 --saves 8 --codec raw]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver

import gdsckpt
from gdsckpt.bench.workload import GPT
from gdsckpt.bench.train_methods import checkpoint_state
from gdsckpt.dcp import CachedSavePlanner, GdsckptWriter


class Ticker:
    """Wakes every `period` s and records (wake time, lateness)."""

    def __init__(self, period=0.001):
        self.period, self.wakes, self.stop = period, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="ticker")
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(self.period)
            now = time.perf_counter()
            self.wakes.append((now, now - t - self.period))

    def late(self, start, end):
        """(ticks, summed lateness) of the wake-ups in [start, end]."""
        lates = [x for t, x in self.wakes if start <= t <= end]
        return len(lates), sum(lates)


class Spans:
    """Thread CPU and wall seconds inside wrapped functions, per (thread role, name)."""

    def __init__(self, caller: int):
        self.caller, self.totals, self.patched = caller, {}, []
        self.depth = threading.local()

    def wrap(self, owner, name: str, label: str | None = None):
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            return
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"
        spans = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                role = "caller" if threading.get_ident() == spans.caller else "background"
                acc = spans.totals.setdefault(role, {}).setdefault(label, [0.0, 0.0, 0])
                acc[0] += time.thread_time() - c
                acc[1] += time.perf_counter() - w
                acc[2] += 1
        setattr(owner, name, timed)
        self.patched.append((owner, name, fn))

    def take(self) -> dict:
        out = {role: {k: {"cpu_s": round(v[0], 5), "wall_s": round(v[1], 5), "calls": v[2]}
                      for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])}
               for role, d in self.totals.items()}
        self.totals = {}
        return out

    def undo(self):
        for owner, name, fn in reversed(self.patched):
            setattr(owner, name, fn)


def wrap_all(spans: Spans, item_spans: bool) -> None:
    from torch.distributed.checkpoint import default_planner, utils
    import gdsckpt.dcp.writer as w
    import gdsckpt.dcp.staging as s
    from gdsckpt.dcp import planner as p
    for name in ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan"):
        spans.wrap(default_planner.DefaultSavePlanner, name)
        spans.wrap(p.CachedSavePlanner, name)
    spans.wrap(default_planner, "create_default_local_save_plan", "dcp.create_default_local_save_plan")
    spans.wrap(default_planner, "flatten_state_dict", "dcp.flatten_state_dict")
    spans.wrap(default_planner, "_compare_save_plans", "dcp._compare_save_plans")
    if item_spans:  # once per tensor: its own timing adds ~2-4 us a call to what it measures
        spans.wrap(default_planner, "_create_write_items", "dcp._create_write_items")
    for name in ("gather_object", "scatter_object", "broadcast_object", "all_gather_object"):
        spans.wrap(utils._DistWrapper, name)
    for name in ("stage", "storage_meta", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
                 "write_data", "finish", "_write_staged", "_plan_is_staged"):
        spans.wrap(GdsckptWriter, name)
    spans.wrap(w, "write_metadata", "gdsckpt.dcp.write_metadata")
    spans.wrap(s, "stage_compressed", "gdsckpt.dcp.stage_compressed")
    spans.wrap(s, "save_flat", "staging.save_flat")
    spans.wrap(state_dict_saver, "_stateful_to_state_dict", "dcp._stateful_to_state_dict")
    for mod_name in ("layout", "plans", "metadata", "results"):  # gdsckpt/dcp modules the tree may have
        try:
            mod = __import__(f"gdsckpt.dcp.{mod_name}", fromlist=["x"])
        except ImportError:
            continue
        for name in getattr(mod, "PROFILED", ()):
            spans.wrap(mod, name, f"gdsckpt.dcp.{mod_name}.{name}")


class GcTimes:
    """Seconds in the cyclic garbage collector, per (thread role, generation): a per-save burst
    of Python objects triggers collections, and a full one walks every object in the process."""

    def __init__(self, caller: int):
        self.caller, self.totals, self.start = caller, {}, {}
        gc.callbacks.append(self.callback)

    def callback(self, phase, info):
        me = threading.get_ident()
        if phase == "start":
            self.start[me] = time.perf_counter()
        elif me in self.start:
            role = "caller" if me == self.caller else "background"
            key = f"{role}/gen{info['generation']}"
            acc = self.totals.setdefault(key, [0.0, 0])
            acc[0] += time.perf_counter() - self.start.pop(me)
            acc[1] += 1

    def take(self) -> dict:
        out = {k: {"s": round(v[0], 5), "collections": v[1]} for k, v in sorted(self.totals.items())}
        self.totals = {}
        return out

    def undo(self):
        gc.callbacks.remove(self.callback)


class Background:
    """DCP's background thread: its save() timed (save_wrapper imports save per call)."""

    def __init__(self):
        self.saver, self.record, self.profile = state_dict_saver.save, [], False
        self.profiles: list = []
        state_dict_saver.save = self.timed

    def timed(self, *args, **kwargs):
        prof = cProfile.Profile() if self.profile else None
        c, t = time.thread_time(), time.perf_counter()
        if prof:
            prof.enable()
        try:
            return self.saver(*args, **kwargs)
        finally:
            if prof:
                prof.disable()
                self.profiles.append(prof)
            self.record.append((time.thread_time() - c, time.perf_counter() - t))

    def undo(self):
        state_dict_saver.save = self.saver


def top(prof, n=30) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def build_state(layers, d, vocab, context):
    torch.manual_seed(0)
    model = GPT(layers, max(1, d // 16), d, vocab, context)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    idx = torch.randint(0, vocab, (2, 17))
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
    opt.step()
    return model, opt


def run(method, args, state_of, root, ticker, bg, spans, gcs):
    rows = []
    for i in range(args.warmup + args.saves):
        path = os.path.join(root, f"{method}-{i}")
        state = state_of()
        profiling = args.profile and i == args.warmup + args.saves - 1
        prof = cProfile.Profile() if profiling else None
        bg.profile = profiling
        spans.take()
        gcs.take()
        n_bg = len(bg.record)
        c0, t0 = time.thread_time(), time.perf_counter()
        if prof:
            prof.enable()
        if method == "dcp":
            planner = CachedSavePlanner(cache_key="dcp_python_cost")
            fut = dcp.async_save(state, storage_writer=GdsckptWriter(path, codec=args.codec), planner=planner)
            fut = getattr(fut, "upload_completion", fut)
        else:
            fut = gdsckpt.save_async(state, path + ".gdsckpt", codec=args.codec)
        if prof:
            prof.disable()
        t1, c1 = time.perf_counter(), time.thread_time()
        fut.result()
        t2 = time.perf_counter()
        time.sleep(0.02)  # the ticker's last late wake-ups, and done callbacks
        ticks, late = ticker.late(t1, t2)
        row = {"call_s": t1 - t0, "call_cpu_s": c1 - c0, "done_s": t2 - t0,
               "late_s": max(0.0, late - ticks * ticker.idle), "ticks": ticks, "spans": spans.take(),
               "gc": gcs.take()}
        row["gc_s"] = sum(v["s"] for v in row["gc"].values())
        if method == "dcp":
            (row["bg_cpu_s"], row["bg_wall_s"]), = bg.record[n_bg:]
        if prof:
            row["profile_caller"] = top(prof)
            if method == "dcp":
                row["profile_background"] = top(bg.profiles[-1])
        rows.append(row)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path + ".gdsckpt"):
            os.unlink(path + ".gdsckpt")
        print(f"{method:10} save {i}: call {row['call_s'] * 1e3:7.1f} ms (cpu {row['call_cpu_s'] * 1e3:6.1f}), "
              f"background cpu {row.get('bg_cpu_s', 0) * 1e3:6.1f} ms, late {row['late_s'] * 1e3:6.1f} ms, "
              f"done {row['done_s'] * 1e3:7.1f} ms, gc {row['gc_s'] * 1e3:5.1f} ms", flush=True)
    return rows[args.warmup:]


def summary(rows):
    keys = ("call_s", "call_cpu_s", "bg_cpu_s", "bg_wall_s", "late_s", "done_s", "gc_s")
    return {k: {"median": round(statistics.median(r[k] for r in rows), 5),
                "min": round(min(r[k] for r in rows), 5), "max": round(max(r[k] for r in rows), 5)}
            for k in keys if k in rows[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--codec", default="raw")
    ap.add_argument("--methods", default="save_async,dcp")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--item-spans", action="store_true", help="also time DCP's per-tensor _create_write_items")
    ap.add_argument("--directory", default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "dcp_python_cost.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, opt = build_state(args.layers, args.d, args.vocab, args.context)
    state_of = lambda: checkpoint_state(model, opt)  # noqa: E731
    tensors = sum(1 for _ in _tensors(state_of()))
    store = tempfile.mktemp(prefix="dcp-python-cost-pg-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="dcp-python-cost-", dir=args.directory)
    ticker = Ticker()
    time.sleep(2.0)
    n, late = ticker.late(0, time.perf_counter())
    ticker.idle = late / max(n, 1)
    spans = Spans(threading.get_ident())
    wrap_all(spans, args.item_spans)
    bg = Background()
    gcs = GcTimes(threading.get_ident())
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
              "commit": _commit(), "state": {"layers": args.layers, "d_model": args.d, "vocab": args.vocab,
                                             "tensors": tensors, "bytes": sum(t.nbytes for t in _tensors(state_of()))},
              "codec": args.codec, "ticker_idle_late_s": ticker.idle, "methods": {}}
    try:
        for method in args.methods.split(","):
            rows = run(method, args, state_of, root, ticker, bg, spans, gcs)
            result["methods"][method] = {"summary": summary(rows), "saves": rows}
    finally:
        bg.undo()
        gcs.undo()
        spans.undo()
        ticker.stop.set()
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    for method, r in result["methods"].items():
        print(method, json.dumps(r["summary"]))
        if args.profile:
            for k in ("profile_caller", "profile_background"):
                if k in r["saves"][-1]:
                    print(f"== {method} {k}\n{r['saves'][-1][k]}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def _tensors(o):
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from _tensors(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from _tensors(v)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    main()
