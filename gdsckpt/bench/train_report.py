"""gdsckpt-bench --train's result: each method's loops summarised against the 'none' loops,
the JSON's shape (TRAIN_SCHEMA_DOC), the printed table and the plot."""

from __future__ import annotations

import statistics
import sys

from . import targets
from .cost import print_cost
from .train_loop import Loop
from .train_methods import Method

TRAIN_SCHEMA = 1
TRAIN_SCHEMA_DOC = """--train JSON: {schema: 1, mode: "train", date, host, device: {kind, name}, versions, io_path,
 model: {size, layers, heads, d_model, vocab, seq, batch, params}, state: {logical_bytes, tensors},
 steps, interval, checkpoints_per_loop (at interval, 2 x interval, ..., each followed by a full interval),
 repeats, sync_every (the loop reads its loss every N steps, the host running ahead between), dcp_planner (cached | default: the DCP methods' save planner), step_s (the 'none' loops' mean),
 methods: [{name, status: ok|error|unavailable, error, loops_s: [per repeat], overhead_per_ckpt_s:
   {mean, min, max, each}, drain_s: [per repeat: the wait for the last write at the loop's end],
   blocked_s: {mean, max, each}, call_s: {mean, max, each} (the call alone: blocked less the optimizer's wait),
   completion_s: {mean, max, each},
   steps_after_ckpt_extra_s: [k = 1..interval: the k-th step after a checkpoint minus the 'none' loop's step at its position],
   gpu_wait_after_ckpt_extra_s: [the same for the part of each step spent in loss.item() waiting for the GPU],
   overhead_local_per_ckpt_s: {mean, min, max, each per repeat, se, n} (the call + the steps after each checkpoint
     beyond the quiet steps around it, less the same in the 'none' loop; where a write outlasted those steps, every
     step up to the next checkpoint against the quiet steps before it; mean null where a write outlasted the
     interval; se: the standard error of the mean over its n checkpoints, all repeats),
   overhead_median_per_ckpt_s: the same window by medians (the call's median + for each step k after a checkpoint
     the median over every checkpoint of its step k beyond its loop's quiet steps' median, summed, less the same in
     the 'none' loops): the few slow steps any loop of the H100 host shows (bench/probes/slow_steps.py) move it
     less than the local estimate's means, and it misses any such step a checkpoint itself causes; null as local,
   raw: [per repeat: {steps_ms, ckpt_steps, calls_ms, completion_s}] (each step's and call's own time, to redo the
     estimates),
   first_save: {blocked_s, completion_s, stats: {mode, snapshot_s, stages, pool_alloc_s, pool_wait_s,
     device_copy_bytes} | null (save_async's)} (outside the loops, after `reserve`),
   reserve: {when, seconds, where, allocated_bytes, held_bytes, limit_bytes, pinned, warm_s, alloc_s, slots} | null
   (what the method's setup reserved ahead of its first save: gdsckpt.reserve / Checkpointer.reserve),
   stored_bytes, gpu: {peak_extra_torch_bytes, peak_extra_device_bytes},
   host: {pinned_torch_bytes, pinned_gdsckpt_bytes (Stats.memory), rss_peak_extra_bytes}, notes,
   memory (--memory's methods: train_memory.CkptMemory.summary; with --replicas its replicas: {replicas, node,
     replicated, checkpoints, replication_s, closed, not_replicated}, and per_checkpoint's replicated_on,
     replication (holder -> outcome), replication_s, replication_bytes, from Checkpointer.status())}],
 cost: {...} | null, targets: [{method, rank, checks: {idle_s | blocked_s | extra_gpu_bytes | durable_x_sync |
   first_blocked_beyond_steady_s: {target, measured, met, short_by}}}] (bench/targets.py; idle_s also says its
   estimate: local | loop, and by_medians: overhead_median_per_ckpt_s);
 under torchrun (rank 0 writes it) also: world_size, model.sharding, state.per_rank_bytes,
 ranks: [{rank, methods: [{name, status, error, overhead_per_ckpt_s, blocked_s, completion_s, first_save, reserve,
   steps_after_ckpt_extra_s, gpu_wait_after_ckpt_extra_s, gpu, host, stored_bytes, memory}]}]}"""


def _summ(xs: list) -> dict:
    if not xs:
        return {"mean": None, "min": None, "max": None, "each": []}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "each": [round(x, 4) for x in xs]}


def method_rows(methods: list[Method], rows: dict, interval: int, ckpts: int) -> list[dict]:
    """Each method's row of the result, in the order run: its loops (rows[name]["loops"], taken
    out of the row) summarised against the 'none' loops of the same repeats."""
    none_loops: list[Loop] = rows["none"]["loops"]
    base_torch = max((l.peak_torch for l in none_loops), default=0)
    base_device = max((l.peak_device for l in none_loops), default=0)
    out = []
    for m in methods:
        row = rows[m.name]
        row["notes"] = row["notes"] or m.notes
        row.update(m.extra())
        loops: list[Loop] = row.pop("loops")
        if loops and none_loops:
            # Paired with the 'none' loop of the same repeat (they ran minutes apart at most).
            over = [(l.seconds - _none_of(none_loops, i).seconds) / ckpts for i, l in enumerate(loops)]
            row.update({
                "loops_s": [round(l.seconds, 4) for l in loops],
                "drain_s": [round(l.drain, 4) for l in loops],
                "overhead_per_ckpt_s": _summ(over if m.name != "none" else []),
                "blocked_s": _summ([b for l in loops for b in l.blocked]),
                "call_s": _summ([c for l in loops for c in l.calls]),
                "completion_s": _summ([c for l in loops for c in l.completion]),
                "steps_after_ckpt_extra_s": _extra_after_ckpt(loops, none_loops, interval) if m.name != "none" else None,
                "gpu_wait_after_ckpt_extra_s": (_extra_after_ckpt(loops, none_loops, interval, "gpu_waits")
                                                if m.name != "none" else None),
                "overhead_local_per_ckpt_s": _local_summary(loops, none_loops, interval) if m.name != "none" else _summ([]),
                "overhead_median_per_ckpt_s": _median_overhead(loops, none_loops, interval) if m.name != "none" else None,
                "raw": [_raw(l) for l in loops],
                "gpu": {"peak_extra_torch_bytes": max(l.peak_torch for l in loops) - base_torch,
                        "peak_extra_device_bytes": max(l.peak_device for l in loops) - base_device},
                "host": {"pinned_torch_bytes": max(l.pinned for l in loops),
                         "pinned_gdsckpt_bytes": row.pop("_pinned", None),
                         "rss_peak_extra_bytes": max(l.rss_extra for l in loops)},
            })
        out.append(row)
    return out


def _none_of(none_loops: list[Loop], i: int) -> Loop:
    """The 'none' loop repeat i is paired with (its own, or the last if there are fewer)."""
    return none_loops[min(i, len(none_loops) - 1)]


def _local_summary(loops: list, none_loops: list, interval: int) -> dict:
    """_summ of each loop's local estimate (against the 'none' loop of its repeat), with the
    standard error of the mean over every checkpoint of every repeat; mean null if any loop has none."""
    each = [_local_per_ckpt(l, _none_of(none_loops, i), interval) for i, l in enumerate(loops)]
    if any(e is None for e in each):
        return {**_summ([]), "se": None, "n": 0}
    every = [x for e in each for x in e]
    se = statistics.stdev(every) / len(every) ** 0.5 if len(every) > 1 else None
    return {**_summ([statistics.fmean(e) for e in each]), "se": se, "n": len(every)}


def _median_overhead(loops: list, none_loops: list, interval: int) -> float | None:
    """overhead_median_per_ckpt_s (TRAIN_SCHEMA_DOC); None where any loop has no local estimate."""
    if any(_local_per_ckpt(l, _none_of(none_loops, i), interval) is None for i, l in enumerate(loops)):
        return None
    quiet = max(1, interval // 4)
    window = interval - quiet

    def beyond(pairs: list) -> float:
        """Sum over k of the median, over (steps, c) pairs, of steps[c + k] beyond the median of
        that loop's quiet steps (the `quiet` before each checkpoint and after its window)."""
        per_k = [[] for _ in range(window)]
        for steps, cks in pairs:
            base = statistics.median([s for c in cks for s in steps[c - quiet:c] + steps[c + window:c + interval]])
            for c in cks:
                for k in range(window):
                    per_k[k].append(steps[c + k] - base)
        return sum(statistics.median(x) for x in per_k)

    calls = [c for l in loops for c in l.calls]
    mine = beyond([(l.steps, l.ckpt_steps) for l in loops])
    base = beyond([(_none_of(none_loops, i).steps, l.ckpt_steps) for i, l in enumerate(loops)])
    return statistics.median(calls) + mine - base


def _raw(loop: Loop) -> dict:
    return {"steps_ms": [round(s * 1e3, 2) for s in loop.steps], "ckpt_steps": list(loop.ckpt_steps),
            "calls_ms": [round(c * 1e3, 2) for c in loop.calls], "completion_s": [round(c, 3) for c in loop.completion],
            "steal_cpu_s": loop.steal_s, "steal_cpu_s_per_interval": list(loop.steal_windows)}


def _local_per_ckpt(loop: Loop, none_loop: Loop, interval: int) -> list | None:
    """Overhead of each checkpoint from the steps around each checkpoint, immune to drift between
    loops (the H100 host's 'none' loops of one run differed by up to 5%, 0.2 s per checkpoint
    at 8 checkpoints per 36 s loop; on the 2x H200 host by 12%): the checkpoint call, plus the
    `interval - quiet` steps after it, each less the mean of the `quiet` steps before it and the
    `quiet` steps that end its interval (the quiet ones: a linear drift cancels); less the same
    sum for the 'none' loop of the repeat at the same steps (position effects cancel). A
    checkpoint whose write outlasted those steps counts every step up to the next checkpoint,
    against the quiet steps before it only (the disk was slow for it: its tail is not dropped).
    None where a write outlasted the whole interval (the next checkpoint's steps carry its tail)
    or the loop has no full interval around a checkpoint."""
    quiet = max(1, interval // 4)
    window = interval - quiet

    def beyond_quiet(steps: list, c: int, span: int) -> float:
        base = statistics.fmean(steps[c - quiet:c] + steps[c + span:c + interval])
        return sum(steps[c:c + span]) - span * base

    if len(loop.completion) != len(loop.ckpt_steps) or not loop.ckpt_steps:
        return None
    per = []
    for c, call, done in zip(loop.ckpt_steps, loop.calls, loop.completion):
        if c < quiet or c + interval > min(len(loop.steps), len(none_loop.steps)):
            return None
        span = window if done <= call + sum(loop.steps[c:c + window]) else interval
        if done > call + sum(loop.steps[c:c + span]):  # the write's tail is in the next interval
            return None
        per.append(call + beyond_quiet(loop.steps, c, span) - beyond_quiet(none_loop.steps, c, span))
    return per


def _extra_after_ckpt(loops: list, none_loops: list, interval: int, what: str = "steps") -> list | None:
    """Where a method's loop time lands: for k = 1..interval, how much longer the k-th training
    step after a checkpoint took than the step at the same position of the same repeat's 'none'
    loop (mean over checkpoints and repeats). Paired by position, not against the 'none' loop's
    median: steps are skewed (a few slow ones), so a median base reads every step as slower.
    A step's time includes any wait the method imposes before opt.step (blocked time, also
    counted there); the checkpoint call itself is not in it.
    what="gpu_waits": the same for the part of each step the host waited for the GPU (more:
    the GPU ran slower; less, with a slower step: the host did)."""
    extra = [[] for _ in range(interval)]
    for i, loop in enumerate(loops):
        base = getattr(_none_of(none_loops, i), what)
        per_step = getattr(loop, what)
        for c in loop.ckpt_steps:
            for k in range(interval):
                if c + k < min(len(per_step), len(base)):
                    extra[k].append(per_step[c + k] - base[c + k])
    return [round(statistics.fmean(e), 4) for e in extra] if extra and extra[0] else None


def rank_row(r: dict) -> dict:
    """The figures of one rank's method row that the per-rank table shows."""
    keep = ("name", "status", "error", "overhead_per_ckpt_s", "blocked_s", "completion_s", "first_save", "reserve",
            "steps_after_ckpt_extra_s", "gpu_wait_after_ckpt_extra_s", "overhead_local_per_ckpt_s", "gpu", "host",
            "stored_bytes", "memory")
    return {k: r[k] for k in keep if k in r}


def loop_record(name: str, repeat: int, rank: int | None, loop: Loop, none_loop: Loop | None, interval: int,
                ckpts: int, stored_bytes: int | None, io_path: str | None) -> dict:
    """One line of --jsonl: a loop's figures as soon as it is measured, against the 'none' loop of
    its repeat where that ran (the result's rows sum every repeat up the same way)."""
    local = _local_per_ckpt(loop, none_loop, interval) if none_loop and name != "none" else None
    return {"kind": "loop", "method": name, "repeat": repeat, "rank": rank, "loop_s": round(loop.seconds, 4),
            "none_loop_s": none_loop and round(none_loop.seconds, 4),
            "overhead_per_ckpt_s": ((loop.seconds - none_loop.seconds) / ckpts
                                    if none_loop and name != "none" and ckpts else None),
            "overhead_local_per_ckpt_s": statistics.fmean(local) if local else None,
            "blocked_s": [round(b, 4) for b in loop.blocked], "call_s": [round(c, 4) for c in loop.calls],
            "completion_s": [round(c, 4) for c in loop.completion], "drain_s": round(loop.drain, 4),
            "stored_bytes": stored_bytes, "io_path": io_path, "raw": _raw(loop)}


def headline(result: dict) -> str | None:
    """The report's first sentence: what a checkpoint cost the loop with each method, against
    torch.save + fsync (under torchrun: dcp.save through FileSystemWriter); None where that was
    not measured."""
    ok = {r["name"]: r for r in result["methods"] if r["status"] == "ok" and r.get("overhead_per_ckpt_s")}
    base_name = next((n for n in ("torch.save", "dcp.save FileSystemWriter") if n in ok), None)
    if base_name is None:
        return None
    base = targets.idle_estimate(ok[base_name])[0]
    if base is None:
        return None
    label = "torch.save + fsync" if base_name == "torch.save" else base_name
    parts = []
    for name, row in ok.items():
        idle = targets.idle_estimate(row)[0]
        if name in ("none", base_name) or idle is None:
            continue
        if base <= 0:  # no ratio to a base the loops could not resolve (a short run on a busy host)
            parts.append(f"{name} {idle:+.3f} s")
        elif idle <= 0.01 * base:
            parts.append(f"{name} nothing measurable ({idle:+.3f} s)")
        elif _within_noise(ok[base_name], row):
            parts.append(f"{name} {idle:.3f} s (level with it: within the loops' noise)")
        else:
            x = base / idle
            parts.append(f"{name} {idle:.3f} s ({x:.1f}x less)" if x >= 1 else f"{name} {idle:.3f} s ({1 / x:.1f}x more)")
    size = result["state"]["logical_bytes"] / 1e6
    cost = f"{base:.3f} s" if base > 0 else f"nothing measurable ({base:+.3f} s: the loops' noise is larger)"
    text = f"Each checkpoint of the {size:.1f} MB state cost the training loop {cost} with {label}"
    return text + ("; " + ", ".join(parts) + "." if parts else ".")


def _within_noise(a: dict, b: dict) -> bool:
    """Whether two method rows' local idle estimates differ by less than twice the standard
    error of their difference (a short run on a busy CPU: a ratio would be noise)."""
    sa, sb = ((r.get("overhead_local_per_ckpt_s") or {}).get("se") for r in (a, b))
    ia, ib = targets.idle_estimate(a), targets.idle_estimate(b)
    if sa is None or sb is None or ia[1] != "local" or ib[1] != "local":
        return False
    return abs(ia[0] - ib[0]) < 2 * (sa * sa + sb * sb) ** 0.5


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _after(r: dict) -> str:
    """steps_after_ckpt_extra_s in a few words: the first three steps, then the rest, summed; and
    of it, the GPU wait's part."""
    extra, gpu = r["steps_after_ckpt_extra_s"], r.get("gpu_wait_after_ckpt_extra_s")
    text = f"{sum(extra[:3]):+.3f} s (steps 1-3) and {sum(extra[3:]):+.3f} s (steps 4-{len(extra)}) beyond 'none'"
    if gpu:
        text += f" (waiting for the GPU {sum(gpu[:3]):+.3f} / {sum(gpu[3:]):+.3f} s)"
    return text


def _every(n: int) -> str:
    return "step" if n == 1 else f"{n} steps (the host ahead of the GPU between)"


def print_train(result: dict, out=None) -> None:
    out = out or sys.stdout
    d = result
    m = d["model"]
    # An interrupted run says so first, with or without a headline (none where torch.save did
    # not run).
    first = " ".join(x for x in (headline(d), d.get("interrupted") and "(Interrupted: from the loops that finished.)") if x)
    if first:
        print(first + "\n", file=out)
    print(f"gdsckpt-bench --train {d['date']}  device: {d['device']['name']}  io: {d['io_path']}", file=out)
    print(f"  model: GPT {m['layers']}x{m['d_model']} ({m['params'] / 1e6:.1f}M params), batch {m['batch']}x{m['seq']}; "
          f"state {d['state']['logical_bytes'] / 1e9:.2f} GB ({d['state']['tensors']} tensors); "
          f"step {_f(d['step_s'] and d['step_s'] * 1e3, '{:.1f}')} ms; a checkpoint every {d['interval']} steps, "
          f"{d['checkpoints_per_loop']} per loop of {d['steps']} steps, {d['repeats']} repeat(s); "
          f"the loss read every {_every(d.get('sync_every', 1))}", file=out)
    if d.get("world_size"):
        print(f"  {d['model']['sharding']}: {d['state']['per_rank_bytes'] / 1e9:.2f} GB of state per rank; "
              "the table is rank 0's, each rank's figures follow it", file=out)
    print(f"\n{'method':<38}{'overhead/ckpt s':>24}{'blocked s':>11}{'blocked max':>12}{'done s':>8}"
          f"{'first s':>9}{'+GPU GiB':>9}{'+dev GiB':>9}{'pinned GiB':>11}{'stored GB':>10}", file=out)
    for r in d["methods"]:
        if r["status"] != "ok" or "overhead_per_ckpt_s" not in r:
            print(f"{r['name']:<38}  {r['status']}: {r['error']}", file=out)
            continue
        o, b, c = r["overhead_per_ckpt_s"], r["blocked_s"], r["completion_s"]
        spread = f" ({_f(o['min'], '{:.2f}')}..{_f(o['max'], '{:.2f}')})" if o["mean"] is not None and len(o["each"]) > 1 else ""
        first = r["first_save"]["blocked_s"] if r.get("first_save") else None
        print(f"{r['name']:<38}{_f(o['mean']) + spread:>24}{_f(b['mean']):>11}{_f(b['max']):>12}{_f(c['mean'], '{:.2f}'):>8}"
              f"{_f(first, '{:.2f}'):>9}{r['gpu']['peak_extra_torch_bytes'] / 2**30:>9.2f}"
              f"{r['gpu']['peak_extra_device_bytes'] / 2**30:>9.2f}{r['host']['pinned_torch_bytes'] / 2**30:>11.2f}"
              f"{_f(r.get('stored_bytes') and r['stored_bytes'] / 1e9):>10}", file=out)
    for r in d["methods"]:
        if r.get("reserve"):
            v = r["reserve"]
            print(f"  {r['name']:<44} reserved before its first save and the loops: "
                  f"{v['allocated_bytes'] / 1e9:.2f} GB ({v['where']}, {'page-locked' if v['pinned'] else 'not page-locked'}) in {v['seconds']:.2f} s "
                  f"(warm-up {v['warm_s']:.2f} s, allocation {v['alloc_s']:.2f} s)", file=out)
    for r in d["methods"]:
        if r.get("steps_after_ckpt_extra_s"):
            loc = r["overhead_local_per_ckpt_s"]
            se = f" +- {loc['se']:.3f} (n={loc['n']})" if loc.get("se") is not None else ""
            median = _f(r.get("overhead_median_per_ckpt_s"))
            print(f"  {r['name']:<44} overhead/ckpt around each checkpoint {_f(loc['mean'])}{se} s "
                  f"(by medians {median} s); steps after a checkpoint took {_after(r)}", file=out)
    for rr in d.get("ranks", []):
        for r in rr["methods"]:
            if r.get("overhead_per_ckpt_s") and r["name"] != "none":
                o, b = r["overhead_per_ckpt_s"], r["blocked_s"]
                print(f"  rank {rr['rank']} {r['name']:<36}{_f(o['mean']):>8} s overhead, {_f(b['mean'])} s blocked "
                      f"(max {_f(b['max'])}), done {_f(r['completion_s']['mean'], '{:.2f}')} s, "
                      f"+GPU {r['gpu']['peak_extra_torch_bytes'] / 2**30:.2f} GiB"
                      + (f"; local overhead {_f(r['overhead_local_per_ckpt_s']['mean'])} s, steps after "
                         f"{_after(r)}" if r.get("steps_after_ckpt_extra_s") else ""),
                      file=out)
    print("  overhead/ckpt: (loop s - the same repeat's 'none' loop s) / checkpoints per loop, mean (min..max);"
          " blocked: the caller's wait per checkpoint; done: call to durable; first: the first save's blocked s,"
          " outside the loops (after the method's reservation, if any); +GPU: torch peak over the 'none' loop;"
          " +dev: device-wide (cudaMemGetInfo, per step); pinned: torch's pinned host allocator", file=out)
    targets.print_targets(d.get("targets") or [], out)
    if d.get("cost"):
        print_cost(d["cost"], out)


def plot_train(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["methods"] if r.get("overhead_per_ckpt_s") and r["name"] != "none"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["overhead_per_ckpt_s"]["mean"] for r in rows], 0.4, label="loop overhead per checkpoint",
           yerr=[[r["overhead_per_ckpt_s"]["mean"] - r["overhead_per_ckpt_s"]["min"] for r in rows],
                 [r["overhead_per_ckpt_s"]["max"] - r["overhead_per_ckpt_s"]["mean"] for r in rows]], capsize=3)
    ax.bar([i + 0.2 for i in x], [r["blocked_s"]["mean"] for r in rows], 0.4, label="caller blocked per checkpoint")
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("seconds")
    ax.legend()
    d = result
    ax.set_title(f"--train {d['date'][:10]} {d['device']['name']}: {d['state']['logical_bytes'] / 1e9:.2f} GB state, "
                 f"checkpoint every {d['interval']} steps", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
