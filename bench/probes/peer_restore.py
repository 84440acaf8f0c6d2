"""Peer replicas on two ranks, each rank a node: what a checkpoint costs the training loop with
replicas=1 (save_async's blocked seconds per call), how long a step takes to reach its holder
(the replication's own seconds and bytes, against the link's measured NCCL bandwidth), and how
fast a lost rank restores its newest step from its peer in a new process, bit-exact, against a
restore of the same state from a cold file.

Backs: issue 46's 2-GPU targets (docs/replicas.md): replication adds <= 0.02 s of GPU idle per
checkpoint per rank; a lost rank's 5 GB state restored from its peer in <= 1.5 s, bit-exact, at
least 3x faster than from its cold local file; the replication at >= 50% of the link's NCCL
bandwidth.

    python bench/probes/peer_restore.py run --nproc 2 --size 5GB --out DIR          # 2 GPUs
    python bench/probes/peer_restore.py run --nproc 2 --device cpu --size 64MB --out DIR

`run` launches three torchrun jobs (python -m torch.distributed.run), wiping node --lost's
memory root between the first two (the node loss), and writes DIR/summary.json:
* save: each rank trains an AdamW model of about --size bytes (fp32 weights and moments; each
  rank seeded differently), saves step 1 (to the directory: every_local's first step) and then
  --saves steps with Checkpointer(memory=True, replicas=1, node=<its node>), a few optimizer steps
  between. Per checkpoint: the call's blocked seconds, idle_s (blocked + how much slower the
  --train-steps after it ran than the same steps with no save in flight: an overlapped snapshot
  is paid in them), when the step was replicated, the replication's own seconds and bytes
  (status()["memory"]["replicas"]["last"]). Then a CRC-64 per tensor of the last step, that
  state saved to the rank's own file without the memory tier (OUT/cold/r<rank>: the cold local
  file), the link's NCCL bandwidth (GPU), and os._exit(0), no close(), as a crash.
* restore: fresh weights, then Checkpointer(...) + restore() timed to the state filled.
* restore-cold: the same from the rank's cold file, after dropping the page cache.
Each phase writes DIR/<phase>-r<rank>.json. Node n's memory root is --memory-roots/n<n>; a node is
one rank, or --ranks-per-node k of them (4 GPUs as 2 nodes of 2: --nproc 4 --ranks-per-node 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("save", "restore", "restore-cold")


def parse_size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
    t = text.strip().upper()
    for u, m in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def args_of(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=("run",) + PHASES)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", default=None, help="state bytes per rank (default 5GB on cuda, 64MB on cpu)")
    p.add_argument("--saves", type=int, default=3, help="memory checkpoints timed (after step 1)")
    p.add_argument("--train-steps", type=int, default=3, help="optimizer steps between checkpoints")
    p.add_argument("--lost", type=int, default=1, help="the node lost (with --ranks-per-node 1: the rank)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks r*k .. r*k+k-1 make node r")
    p.add_argument("--dir", type=Path, default=None, help="the checkpoint directory (default OUT/ck)")
    p.add_argument("--memory-roots", type=Path, default=Path("/dev/shm/gdsckpt-peer-restore"))
    p.add_argument("--keep", action="store_true", help="run: leave the memory roots and directories")
    a = p.parse_args(argv)
    a.size = parse_size(a.size or ("5GB" if a.device == "cuda" else "64MB"))
    a.dir = a.dir or a.out / "ck"
    return a


# ------------------------------------------------------------------ the state
def make_state(size: int, device, seed: int):
    """A stack of Linear layers whose fp32 weights + AdamW's two moments come to about `size`
    bytes, after one optimizer step (the moments exist)."""
    import torch
    d = 4096 if size >= 2e9 else 1024
    layers = max(1, round(size / 12 / (d * d + d)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train(model, opt, 1, seed)
    return model, opt


def train(model, opt, steps: int, seed: int) -> None:
    import torch
    d = model[0].in_features
    g = torch.Generator(device=model[0].weight.device).manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, d, device=model[0].weight.device, generator=g)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync(model)


def sync(model) -> None:
    import torch
    if model[0].weight.is_cuda:
        torch.cuda.synchronize()


def digests(model, opt) -> dict:
    """CRC-64/NVME of every tensor's bytes (CPU copies), model and optimizer state."""
    import torch
    from gdsckpt.format.checksum import crc64nvme
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        tensors.update({f"optim.{pid}.{k}": v for k, v in st.items() if hasattr(v, "view")})
    return {k: f"{crc64nvme(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()):016x}"
            for k, v in tensors.items()}


def state_bytes(model, opt) -> int:
    n = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    return n + sum(v.numel() * v.element_size() for st in opt.state_dict()["state"].values()
                   for v in st.values() if hasattr(v, "numel"))


# ------------------------------------------------------------------ a phase, on each rank
def timed_saves(a, ck, model, opt, base: float, rank: int, replicas: bool) -> tuple[list, dict]:
    """--saves checkpoints (steps 2, 3, ...), --train-steps between: per checkpoint the call's
    blocked seconds, the training after it (idle_s: blocked + its slowdown against `base`), and
    with replicas the replication's own seconds and its wire's timings."""
    state, saves, reps = {"model": model, "optim": opt}, [], {}
    for step in range(2, 2 + a.saves):
        train(model, opt, a.train_steps, seed=1000 * rank + step)
        t = time.perf_counter()
        ck.save_async(step, state)
        sync(model)
        call = time.perf_counter() - t
        after = None
        if replicas and step == 1 + a.saves:  # the state restored later: its digests before it changes
            (a.out / f"digests-r{rank}.json").write_text(json.dumps(digests(model, opt)))
        else:
            train(model, opt, a.train_steps, seed=1000 * rank + step + 500)  # training goes on
            after = time.perf_counter() - t - call  # the steps a snapshot may overlap (and slow)
        ck.wait()
        row = {"step": step, "blocked_s": call, "train_after_s": after,
               "idle_s": None if after is None else call + max(0.0, after - base),
               "committed_s": time.perf_counter() - t}
        if replicas:
            replicated = ck.memory.wait_replicas(600)
            reps = ck.status()["memory"]["replicas"]
            last = reps["last"] or {}
            mine = last.get("step") == step
            row.update(replicated_after_s=time.perf_counter() - t, replicated=replicated,
                       replicated_on=reps["steps"].get(step, {}).get("replicated_on"),
                       replication_s=last.get("seconds") if mine else None,
                       replication_bytes=last.get("bytes") if mine else None,
                       wire=last.get("wire") if mine else None)
        saves.append(row)
    return saves, reps


def phase_main(a) -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    node = rank // a.ranks_per_node
    os.environ["GDSCKPT_MEMORY_ROOT"] = str(a.memory_roots / f"n{node}")  # before gdsckpt is imported
    (a.memory_roots / f"n{node}").mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist
    if a.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    import gdsckpt
    from gdsckpt import Checkpointer
    out = {"phase": a.phase, "rank": rank, "world": dist.get_world_size(), "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "gdsckpt": getattr(gdsckpt, "__version__", None)}
    if a.phase == "save":
        model, opt = make_state(a.size, device, seed=rank)
        state = {"model": model, "optim": opt}
        out["state_bytes"] = state_bytes(model, opt)
        t = time.perf_counter()
        train(model, opt, a.train_steps, seed=1000 * rank)
        out["train_baseline_s"] = base = time.perf_counter() - t  # the steps with no save in flight
        # the same loop without replicas first (another directory, so another memory tier): what
        # replication adds is the difference, measured in one run
        ck0 = Checkpointer(a.dir.with_name(a.dir.name + "-noreplicas"), memory=True, node=node, every_local=1000,
                           distributed=True)
        t = time.perf_counter()
        ck0.reserve(state, wait=True)  # the tier's slots made and page-locked before any save, as a user would
        out["reserve_without_replicas_s"] = time.perf_counter() - t
        ck0.save_async(1, state)  # its first step goes to the directory, as the run's below does
        ck0.wait()
        out["saves_without_replicas"], _ = timed_saves(a, ck0, model, opt, base, rank, replicas=False)
        ck0.close()
        ck = Checkpointer(a.dir, memory=True, replicas=1, node=node, every_local=1000, distributed=True)
        t = time.perf_counter()
        ck.reserve(state, wait=True)  # its own slots and the segments of the replicas it holds
        out["reserve_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ck.save_async(1, state)
        ck.wait()
        out["step1_to_directory_s"] = time.perf_counter() - t
        out["saves"], reps = timed_saves(a, ck, model, opt, base, rank, replicas=True)
        step = 1 + a.saves
        out["last_step"] = step
        out["replicas_status"] = {k: reps[k] for k in ("holders", "held_for", "closed", "received") if k in reps}
        # the same state in the rank's own file (not a DCP step: DCP keeps one copy of a plain tensor
        # every rank names alike, and these ranks' tensors differ, as FSDP's shards would)
        ck2 = Checkpointer(a.out / "cold" / f"r{rank}", distributed=False)
        t = time.perf_counter()
        ck2.save(step, state)
        out["cold_save_s"] = time.perf_counter() - t
        if device.type == "cuda":
            out["nccl"] = link_bandwidth(device)
        dist.barrier()
        write(a, out)
        dist.barrier()
        os._exit(0)  # no close(): the memory copies stay as a crash leaves them
    # restore, restore-cold: fresh weights of the same shapes, then the restore timed
    model, opt = make_state(a.size, device, seed=100 + rank)
    state = {"model": model, "optim": opt}
    if a.phase == "restore-cold":
        out["page_cache"] = drop_cache(a.out / "cold" / f"r{rank}", local == 0)
    dist.barrier()
    t = time.perf_counter()
    if a.phase == "restore":
        ck = Checkpointer(a.dir, memory=True, replicas=1, node=node, every_local=1000, distributed=True)
    else:
        ck = Checkpointer(a.out / "cold" / f"r{rank}", distributed=False)
    out["open_s"] = time.perf_counter() - t  # the Checkpointer made (with replicas: its groups)
    r = ck.restore(state)
    sync(model)
    out["restore_s"] = time.perf_counter() - t
    if a.phase == "restore":
        out["fetched"] = ck.status()["memory"]["replicas"].get("fetched")
        # after the restore, in the background: a step whose holder lost its replica is sent to it again
        t = time.perf_counter()
        ck.memory.wait_replicas(120)
        st = ck.status()["memory"]
        out["after_restore"] = {"held": st["steps"], "replicated_again_s": time.perf_counter() - t,
                                "replicated_on": st["replicas"]["steps"].get(r.step, {}).get("replicated_on"),
                                "last": st["replicas"]["last"]}
    want = json.loads((a.out / f"digests-r{rank}.json").read_text())
    got = digests(model, opt)
    out.update(step=r.step, source=r.source, skipped=[list(map(str, s)) for s in r.skipped],
               state_bytes=state_bytes(model, opt), bit_exact=got == want,
               mismatched=sorted(k for k in want if got.get(k) != want[k])[:10],
               io_path=getattr(r.stats, "io_path", None), stats=repr(r.stats)[:300])
    write(a, out)
    dist.barrier()
    ck.close()
    dist.destroy_process_group()


def link_bandwidth(device, nbytes: int = 1 << 30) -> dict:
    """1 GiB each way at once between the two GPUs (send/recv, as the replication's two
    directions run), an all_reduce of 1 GiB, and 1 GiB copied host -> device and device -> host
    (page-locked); GB/s per direction, best of 3."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    buf, into = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    out = {"bytes": nbytes}
    for name, fn in (("sendrecv", lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, into, (rank - 1) % world)])]),
                     ("all_reduce", lambda: dist.all_reduce(buf))):
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        busbw = nbytes / best / 1e9 * (2 * (world - 1) / world if name == "all_reduce" else 1)
        out[f"{name}_GBps"] = busbw
    # a replica's bytes cross PCIe twice (host -> device on the origin, device -> host on the
    # holder): the copy rates between page-locked host memory and this GPU, every rank at once
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[f"{name}_GBps"] = nbytes / best / 1e9
    return out


def drop_cache(folder: Path, everything: bool) -> str:
    """posix_fadvise(DONTNEED) on every file of `folder` (after fsync); everything: also drop the
    whole page cache where this process may (root)."""
    from gdsckpt.bench.disk import drop_page_cache
    for f in folder.rglob("*"):
        if f.is_file():
            drop_page_cache(f)
    if everything:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "fadvise_dontneed+drop_caches"
        except OSError:
            pass
    return "fadvise_dontneed"


def write(a, out: dict) -> None:
    (a.out / f"{a.phase}-r{out['rank']}.json").write_text(json.dumps(out, indent=1, default=str))
    if out["rank"] == 0:
        print(f"peer_restore {a.phase}: " + json.dumps({k: v for k, v in out.items() if k in (
            "state_bytes", "reserve_s", "step1_to_directory_s", "restore_s", "step", "source", "bit_exact", "nccl", "io_path")},
            default=str), flush=True)


# ------------------------------------------------------------------ the whole run
def run_all(a) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    dirs = (a.memory_roots, a.dir, a.dir.with_name(a.dir.name + "-noreplicas"), a.out / "cold")
    for p in dirs:
        shutil.rmtree(p, ignore_errors=True)
    common = ["--out", str(a.out), "--device", a.device, "--size", str(a.size), "--saves", str(a.saves),
              "--train-steps", str(a.train_steps), "--lost", str(a.lost), "--dir", str(a.dir),
              "--memory-roots", str(a.memory_roots), "--ranks-per-node", str(a.ranks_per_node)]
    try:
        for phase in PHASES:
            if phase == "restore":  # the node is lost: its memory (its copies and the replicas it held)
                shutil.rmtree(a.memory_roots / f"n{a.lost}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
                   __file__, phase, *common]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, timeout=3600)
    finally:
        if not a.keep:
            for p in dirs:
                shutil.rmtree(p, ignore_errors=True)
    print(json.dumps(summarize(a), indent=1))


def summarize(a) -> dict:
    ranks = []
    for r in range(a.nproc):
        s, m, c = (json.loads((a.out / f"{p}-r{r}.json").read_text()) for p in PHASES)
        link = (s.get("nccl") or {}).get("sendrecv_GBps")
        rep = [(x["replication_bytes"] / x["replication_s"] / 1e9) for x in s["saves"] if x["replication_s"]]
        ranks.append({
            "rank": r, "node": r // a.ranks_per_node, "lost": r // a.ranks_per_node == a.lost,
            "state_bytes": s["state_bytes"],
            "blocked_s_per_checkpoint": [x["blocked_s"] for x in s["saves"]],
            "idle_s_per_checkpoint": [x["idle_s"] for x in s["saves"]],
            "idle_s_per_checkpoint_without_replicas": [x["idle_s"] for x in s.get("saves_without_replicas", [])],
            "wire": [x.get("wire") for x in s["saves"]], "received": s["replicas_status"].get("received"),
            "replication_s": [x["replication_s"] for x in s["saves"]],
            "replication_bytes": [x["replication_bytes"] for x in s["saves"]],
            "replicated_on": [x["replicated_on"] for x in s["saves"]],
            "replication_GBps": rep, "link_GBps": link,
            "replication_of_link": [g / link for g in rep] if link else None,
            "restore_s": m["restore_s"], "restore_open_s": m.get("open_s"), "fetched": m.get("fetched"),
            "after_restore": m.get("after_restore"),
            "restore_step": m["step"], "restore_source": m["source"],
            "restore_io_path": m["io_path"], "cold_restore_s": c["restore_s"], "cold_source": c["source"],
            "cold_page_cache": c.get("page_cache"), "speedup": c["restore_s"] / m["restore_s"],
            "bit_exact": m["bit_exact"], "cold_bit_exact": c["bit_exact"]})
    s0 = json.loads((a.out / "save-r0.json").read_text())
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": s0["device_name"],
           "torch": s0["torch"], "gdsckpt": s0["gdsckpt"], "size": a.size, "saves": a.saves, "lost": a.lost,
           "ranks_per_node": a.ranks_per_node, "nccl": s0.get("nccl"), "ranks": ranks,
           "lost_from_peer": all(x["restore_source"] == "peer" for x in ranks if x["lost"]),
           "all_bit_exact": all(x["bit_exact"] and x["cold_bit_exact"] for x in ranks)}
    (a.out / "summary.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's gdsckpt, installed or not
    args = args_of()
    if args.phase == "run":
        run_all(args)
    else:
        phase_main(args)
