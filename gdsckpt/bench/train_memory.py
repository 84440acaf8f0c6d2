"""gdsckpt-bench --train --memory: the memory tier in the training loop, and its restores.

    gdsckpt-bench --train --memory --interval 10 --every-local 4 [--memory-remote s3://bucket/prefix]

adds the method "gdsckpt Checkpointer memory" (Checkpointer(memory=True, every_local=N): a copy in
shared memory every --interval steps, every N-th also written to the directory) to the loop's
methods (with --methods unset: none and gdsckpt.save_async beside it, at the same interval). Per
checkpoint it reports, beside the loop's idle time and blocked time: the call to the memory
commit, the call to durable for the steps written to the directory (None where a write was
coalesced), and how many steps the directory's newest step was behind the one saved.

After the loops, the trained state is saved once by a Checkpointer with the memory tier (and,
with --memory-remote, uploaded), and it is restored three ways, each in a NEW PROCESS (a restart:
each pays the same start-up), timed from the Checkpointer's construction to the state filled on
the device, and checked bit for bit against the state saved (a CRC-64 per tensor): from memory,
from the local file cold (its page cache dropped first), and from the store. The targets (issue 21): from memory <= 0.5 s on a GPU, and
<= 0.5 x the cold local file on the CPU; idle time per memory checkpoint no higher than
save_async's.

Under torchrun, `--replicas N` adds "gdsckpt Checkpointer memory replicas=N" beside the memory
tier alone, in the same run: each rank's copy also held in the memory of N ranks on other nodes
(docs/replicas.md). Where every rank is on one host, each rank is a node of its own (node=rank,
its memory root a folder of its own under the tier's root: node_per_rank), as the replica tests
simulate nodes. Per checkpoint and rank, from Checkpointer.status(): on which holders the step
ended replicated (or why not) and how long its replication took. The target (issue 46):
replication adds <= 0.02 s of GPU idle per checkpoint per rank, against the memory tier alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from .targets import idle_estimate
from .train_methods import Method, checkpoint_state, reservation

NAME = "gdsckpt Checkpointer memory"
RESTORE_TARGET_GPU_S = 0.5
RESTORE_TARGET_CPU_X = 0.5
REPLICATION_IDLE_TARGET_S = 0.02  # issue 46: GPU idle replication adds per checkpoint per rank
REPLICAS_WAIT_S = 600  # at the end: the last step's replication, waited for before the tier closes


def add_arguments(g) -> None:
    g.add_argument("--memory", action="store_true",
                   help="add the memory tier (Checkpointer(memory=True)); its restores timed in a new process")
    g.add_argument("--every-local", type=int, default=4,
                   help="--memory: write every N-th memory checkpoint to the directory (default 4)")
    g.add_argument("--memory-remote", default=None,
                   help="--memory: also upload the restore test's step to this s3://bucket/prefix and time its restore")
    g.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="--memory under torchrun: the memory tier with replicas=N too, in the same run (on one "
                        "host each rank is a node)")


def methods(every_local: int, replicas: int) -> list:
    """The memory tier's methods: alone, and with `replicas` peer replicas where asked."""
    return [CkptMemory(every_local)] + ([CkptMemory(every_local, replicas)] if replicas else [])


@contextlib.contextmanager
def node_per_rank(rk, replicas: int):
    """Under torchrun with replicas, where every rank is on one host: each rank its own node, its
    memory root (GDSCKPT_MEMORY_ROOT, read by the tier whenever it looks for its folders) a
    folder of its own under the root, removed at the end. Yields {"rank": node} or None (the
    nodes torchrun names: several hosts, or no replicas)."""
    import socket
    from gdsckpt.manager.memory.folders import ROOT_ENV, memory_root
    if rk is None or not replicas or len(set(rk.gather(socket.gethostname()))) > 1:
        yield None
        return
    before = os.environ.get(ROOT_ENV)
    root = tempfile.mkdtemp(prefix=f"gdsckpt-bench-node{rk.rank}-", dir=memory_root())
    os.environ[ROOT_ENV] = root
    try:
        yield {"node": rk.rank, "memory_root": root}
    finally:
        if before is None:
            os.environ.pop(ROOT_ENV, None)
        else:
            os.environ[ROOT_ENV] = before
        shutil.rmtree(root, ignore_errors=True)


class CkptMemory(Method):
    """Checkpointer(memory=True, every_local=N).save_async every interval: one Checkpointer for
    every loop, in a directory beside the loops' (which is emptied between loops; under torchrun
    one rank 0 made), its steps numbered on across loops. Its setup reserves the tier's slots
    (Checkpointer.reserve, waited for: each slot made and, on a GPU host, page-locked before the
    first save and the loops), so that its first save, like the loops', takes a slot that exists.
    replicas: Checkpointer(replicas=N, node=the rank's node where node_per_rank set one); the
    replication's outcome per step read from status() off the training thread, after each commit."""

    asynchronous = True
    sharded = True

    def __init__(self, every_local: int = 4, replicas: int = 0):
        self.every_local, self.replicas = every_local, replicas
        self.name = NAME + (f" replicas={replicas}" if replicas else "")
        self.node = None  # this rank's node= (node_per_rank), else torchrun's
        self.ck = None
        self.ranks = None
        self.root: Path | None = None
        self.step = 0
        self.records: list[dict] = []
        self.tier: dict = {}  # the tier's status() at the end: cap, slots' bytes, fallbacks, coalesced
        self.replication: dict[int, dict] = {}  # step -> what status() said of its replication
        self.polls = None  # the thread that reads status() after each commit
        self.closed: dict = {}  # holder -> why its channel closed (status())

    def available(self):
        if self.replicas and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return "replicas need other ranks to hold them: run under torchrun (each rank a node on one host)"
        return None

    def setup(self, ctx) -> None:
        from concurrent.futures import ThreadPoolExecutor
        from gdsckpt import Checkpointer
        self.ranks = ctx.ranks
        root = tempfile.mkdtemp(prefix="gdsckpt-bench-memory-", dir=ctx.directory.parent) if (
            not ctx.ranks or ctx.ranks.rank == 0) else None
        if ctx.ranks:  # one directory for every rank (DCP's steps), rank 0's
            import torch.distributed as dist
            box = [root]
            dist.broadcast_object_list(box, src=0, group=ctx.ranks.group)
            root = box[0]
        self.root = Path(root)
        kw = {"replicas": self.replicas, "node": self.node} if self.replicas else {}
        self.ck = Checkpointer(self.root / "ckpt", memory=True, every_local=self.every_local, **kw)
        if self.replicas:
            self.polls = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-bench-replicas")
        self.reserved = reservation(lambda: self.ck.reserve(ctx.state()) if hasattr(self.ck, "reserve") else None)

    def save(self, ctx, state, path):
        tag = path.name.partition("-step")[0]
        self.step += 1
        step = self.step
        local = self.ck.memory.next_is_local()
        disk = self.ck.layout.local_steps()
        rec = {"loop": tag, "step": step, "local": local, "behind_steps": step - disk[-1] if disk else None,
               "memory_s": None, "durable_s": None, "coalesced": False}
        self.records.append(rec)
        # Under torchrun a step due in the directory is a DCP checkpoint, not held in memory: its
        # future is its write's (no local write from memory follows)
        dcp_step = local and self.ranks is not None
        durable = self.ck.memory.when_written(step) if local and not dcp_step else None
        t = time.perf_counter()
        fut = self.ck.save_async(step, state)
        handle = Future()

        def committed(f):
            rec["durable_s" if dcp_step else "memory_s"] = time.perf_counter() - t
            if self.polls is not None and not dcp_step:  # off this thread, which may hold the tier's locks
                self.polls.submit(self._poll)
            if f.exception() is not None:
                handle.set_exception(f.exception())
            elif durable is None:
                # a Stats (the memory copy's file bytes); a DCP step's Metadata has none
                ctx.stored_bytes = getattr(f.result(), "file_bytes", None) or ctx.stored_bytes
                ctx.io_path = getattr(f.result(), "io_path", None) or ctx.io_path  # "memory"
                handle.set_result(None)
            else:
                durable.add_done_callback(written)

        def written(f):
            if f.exception() is not None:
                handle.set_exception(f.exception())
                return
            rec["durable_s"] = time.perf_counter() - t if f.result() is not None else None
            rec["coalesced"] = f.result() is None
            handle.set_result(None)
        fut.add_done_callback(committed)
        return handle

    def _poll(self) -> None:
        """What status() says of each step's replication: the holders that committed it, each
        holder's outcome, and the last replication's seconds and bytes (status keeps the last
        only: read after every commit, it names each step's in turn)."""
        reps = self.ck.status()["memory"].get("replicas") or {}
        for step, st in (reps.get("steps") or {}).items():
            r = self.replication.setdefault(int(step), {"replicated_on": [], "holders": {}, "seconds": None,
                                                        "bytes": None})
            r["replicated_on"] = list(st.get("replicated_on") or r["replicated_on"])
            r["holders"].update({int(h): what for h, what in (st.get("holders") or {}).items()})
        last = reps.get("last")
        if last:
            r = self.replication.setdefault(int(last["step"]), {"replicated_on": [], "holders": {}})
            r.update(seconds=last["seconds"], bytes=last["bytes"])
        self.closed = dict(reps.get("closed") or {})

    def teardown(self) -> None:
        if self.ck is not None:
            if self.replicas:
                self.ck.memory.wait_replicas(REPLICAS_WAIT_S)
                self.polls.shutdown(wait=True)
                self._poll()
            self.tier = {k: v for k, v in self.ck.status()["memory"].items() if k not in ("dropped", "replicas")}
            self.ck.release_memory()
            self.ck.close()
            self.ck = None
        if self.ranks:  # every rank done with the directory before rank 0 removes it
            self.ranks.barrier()
        if self.root is not None and (not self.ranks or self.ranks.rank == 0):
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def extra(self) -> dict:
        return {"memory": self.summary()}

    def summary(self) -> dict:
        """Per checkpoint, over the timed loops (the first save apart)."""
        recs = [r for r in self.records if not r["loop"].startswith("first")]
        mem = [r["memory_s"] for r in recs if r["memory_s"] is not None]
        dur = [r["durable_s"] for r in recs if r["durable_s"] is not None]
        behind = [r["behind_steps"] for r in recs if r["behind_steps"] is not None]
        out = {"every_local": self.every_local, "checkpoints": len(recs),
                "local_writes": sum(r["local"] for r in recs), "coalesced": sum(r["coalesced"] for r in recs),
                "memory_commit_s": _stats(mem), "durable_s": _stats(dur),
                "behind_steps": {"mean": sum(behind) / len(behind) if behind else None,
                                 "max": max(behind, default=None)},
                "fallbacks": self.tier.get("fallbacks", []), "cap_bytes": self.tier.get("cap_bytes"),
                "held_bytes": self.tier.get("held_bytes"), "pinned_bytes": self.tier.get("pinned_bytes"),
                "per_checkpoint": recs}
        if self.replicas:
            out["replicas"] = self.replication_summary(recs)
        return out

    def replication_summary(self, recs: list[dict]) -> dict:
        """Per checkpoint of the loops: on which holders it ended replicated, why not, and the
        replication's own seconds (from the offer to the last holder's acknowledgement)."""
        for rec in recs:
            r = self.replication.get(rec["step"], {})
            rec.update(replicated_on=r.get("replicated_on", []), replication=r.get("holders", {}),
                       replication_s=r.get("seconds"), replication_bytes=r.get("bytes"))
        secs = [r["replication_s"] for r in recs if r["replication_s"] is not None]
        return {"replicas": self.replicas, "node": self.node,
                "replicated": sum(bool(r["replicated_on"]) for r in recs), "checkpoints": len(recs),
                "replication_s": _stats(secs), "closed": self.closed,
                "not_replicated": {r["step"]: r["replication"] for r in recs if not r["replicated_on"]}}


def _stats(xs: list) -> dict:
    return {"mean": sum(xs) / len(xs) if xs else None, "max": max(xs, default=None), "each": [round(x, 4) for x in xs]}


# ---------------------------------------------------------------- restores in a new process


def digests(state) -> dict[str, str]:
    """A CRC-64/NVME of every tensor's bytes, by key (host copies, one tensor at a time)."""
    from gdsckpt.format.checksum import crc64nvme
    from gdsckpt.format.tree import flatten
    _, leaves = flatten(state)
    return {l.key: f"{crc64nvme(l.tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()):016x}"
            for l in leaves}


def measure_restores(size: str, device: str, model, opt, directory: Path, remote: str | None) -> dict:
    """Save the trained state once (memory tier on), then restore it in a new process."""
    from gdsckpt import Checkpointer
    from gdsckpt.manager.memory.folders import drop_copies
    d = Path(tempfile.mkdtemp(prefix="gdsckpt-bench-restore-", dir=directory))
    try:
        state = checkpoint_state(model, opt)
        with Checkpointer(d, memory=True, remote=remote) as ck:
            ck.save(1, state)
            if remote:
                ck.wait(uploads=True)
        (d / "digests.json").write_text(json.dumps(digests(state)))
        out = {}
        for what in ("memory", "local_cold") + (("remote",) if remote else ()):
            cmd = [sys.executable, "-m", "gdsckpt.bench.train_memory", what, str(d), size, device, remote or ""]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                out[what] = {"error": done.stderr[-4000:]}
                continue
            out[what] = json.loads(done.stdout.strip().splitlines()[-1])
        out["targets"] = _restore_targets(out, device)
        return out
    finally:
        drop_copies(d)
        shutil.rmtree(d, ignore_errors=True)


def _restore_targets(out: dict, device: str) -> dict:
    mem, local = out["memory"].get("seconds"), out["local_cold"].get("seconds")
    if device.startswith("cuda"):
        target = RESTORE_TARGET_GPU_S
    else:
        target = RESTORE_TARGET_CPU_X * local if local else None
    return {"restore_from_memory_s": {"target": target, "measured": mem,
                                      "met": None if target is None or mem is None else mem <= target}}


def idle_target(methods: list[dict]) -> dict:
    """Idle time per memory checkpoint against save_async's in the same run (under torchrun: its
    per-rank save_async); with replicas, what they add to the memory tier alone."""
    by = {m["name"]: m for m in methods}
    mem = by.get(NAME)
    ref = by.get("gdsckpt.save_async") or by.get("gdsckpt.save_async per rank, no DCP")
    a, b = (_idle(m) for m in (mem, ref))
    out = {"idle_s_vs_save_async": {"target": b, "measured": a, "met": None if a is None or b is None else a <= b}}
    for name, row in by.items():
        if name.startswith(NAME + " replicas="):
            r = _idle(row)
            extra = None if r is None or a is None else r - a
            out[f"replication_idle_extra_s ({name.rpartition(' ')[2]})"] = {
                "target": REPLICATION_IDLE_TARGET_S, "measured": extra,
                "met": None if extra is None else extra <= REPLICATION_IDLE_TARGET_S}
    return out


def _idle(row: dict | None) -> float | None:
    return idle_estimate(row)[0] if row and row.get("status") == "ok" and row.get("overhead_per_ckpt_s") else None


def _restore_child(what: str, d: Path, size: str, device: str, remote: str | None) -> dict:
    from gdsckpt import Checkpointer
    from .disk import drop_page_cache
    from .train_loop import build
    want = json.loads((d / "digests.json").read_text())
    model, opt, _, _ = build(size, device)
    for p in model.parameters():  # AdamW's state, as a restarted run has it after its first step
        p.grad = torch.zeros_like(p)
    opt.step()
    state = checkpoint_state(model, opt)
    for t in _tensors(state):
        t.zero_()
    empty = Path(tempfile.mkdtemp(prefix="gdsckpt-bench-remote-"))
    try:
        if what == "local_cold":
            for p in d.glob("step_*"):
                drop_page_cache(p)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ck = (Checkpointer(d, memory=True) if what == "memory" else Checkpointer(d) if what == "local_cold"
              else Checkpointer(empty, remote=remote))
        r = ck.restore(state)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        ck.close()
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    return {"seconds": seconds, "source": r.source, "bit_exact": digests(state) == want,
            "stats": {k: round(v, 4) for k, v in (r.stats.stages if r.stats is not None else {}).items()}}


def _tensors(state):
    from gdsckpt.format.tree import flatten
    return [l.tensor for l in flatten(state)[1]]


def print_memory(m: dict, out=None) -> None:
    out = out or sys.stdout
    s = m.get("loop") or {}
    if s:
        print(f"\nmemory tier (every {s['every_local']}th memory checkpoint written to the directory): "
              f"{s['checkpoints']} checkpoints, {s['local_writes']} local writes due, {s['coalesced']} coalesced; "
              f"call to memory commit {_f(s['memory_commit_s']['mean'])} s (max {_f(s['memory_commit_s']['max'])}), "
              f"call to durable {_f(s['durable_s']['mean'])} s; the directory's newest step behind by "
              f"{_f(s['behind_steps']['mean'], '{:.1f}')} steps on average (max {s['behind_steps']['max']}); "
              f"held {_f(s['held_bytes'] and s['held_bytes'] / 1e9)} GB of a {_f(s['cap_bytes'] and s['cap_bytes'] / 1e9)} "
              f"GB cap, {_f(s['pinned_bytes'] and s['pinned_bytes'] / 1e9)} GB page-locked", file=out)
        for fb in s["fallbacks"][:3]:
            print(f"  NOT IN MEMORY: step {fb['step']}: {fb['why']}", file=out)
    r = m.get("restore") or {}
    for what in ("memory", "local_cold", "remote"):
        x = r.get(what)
        if x and "error" in x:
            print(f"  restore in a new process from {what:<10} failed: {x['error']}", file=out)
        elif x:
            print(f"  restore in a new process from {what:<10} {x['seconds']:.3f} s (source {x['source']}, "
                  f"bit-exact: {x['bit_exact']})", file=out)
    for name, rep in (m.get("replicas") or {}).items():
        for rank, x in enumerate(rep):
            if not x:
                print(f"  {name} rank {rank}: no replication measured", file=out)
                continue
            print(f"  {name} rank {rank} (node {x['node'] if x['node'] is not None else 'torchrun'}): "
                  f"{x['replicated']}/{x['checkpoints']} checkpoints replicated, replication "
                  f"{_f(x['replication_s']['mean'])} s (max {_f(x['replication_s']['max'])})"
                  + (f"; channels closed: {x['closed']}" if x["closed"] else ""), file=out)
            for step, why in list(x["not_replicated"].items())[:3]:
                print(f"    step {step} not replicated: {why or 'no outcome in status()'}", file=out)
    for name, t in {**(r.get("targets") or {}), **(m.get("targets") or {})}.items():
        print(f"  target {name}: {_f(t['target'])} measured {_f(t['measured'])} -> "
              f"{'met' if t['met'] else 'not met' if t['met'] is not None else '-'}", file=out)


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


if __name__ == "__main__":  # the restore test's new process: WHAT DIR SIZE DEVICE REMOTE
    a = sys.argv[1:]
    print(json.dumps(_restore_child(a[0], Path(a[1]), a[2], a[3], a[4] or None)))
