"""Where a rank's blocked time goes in dcp.async_save with GdsckptWriter (issue 13, 2x H200).

Under torchrun, the bench's FSDP2 GPT (gdsckpt-bench --train's model, --size), trained a few
steps so AdamW holds its state. Then, REPEATS times each, after a training step (its .item()
has synchronized, as in the bench loop):
  state:     get_state_dict(model, opt) (the DTensor shards the bench checkpoints)
  stage:     GdsckptWriter.stage(state) = stage_compressed: stand-ins + save_flat into the pool,
             with the save's own stage timings (Stats.stages)
  async:     the whole dcp.async_save call (stage + DCP's synchronous part), as the bench's
             blocked time
  save_async: gdsckpt.save_async on the same local shards as a plain dict (no DCP)
  overlap:   GdsckptWriter(optimizer=opt)'s call-time part: optimizer_memory(opt) and the walk
             that keeps what only the step changes and copies the rest (overlap_walk_s); the
             whole dcp.async_save call (overlap_async_s); call to staging_completion
             (overlap_staged_s: the snapshot, on its thread)
and one cProfile of get_state_dict + dcp.async_save on rank 0 (top functions by own time and
by cumulative time). Then DCP's background thread: its CPU seconds per save (time.thread_time
around DCP's save in that thread; its Python work holds the GIL the training loop needs),
with DCP's DefaultSavePlanner and with gdsckpt.dcp.CachedSavePlanner, and a cProfile of the
last cached save's background on rank 0. Writes $OUT/dcp_stage_profile.json; the profiles go
to stdout.

Backs: docs/measured.md "Two GPUs, per rank": where a rank's blocked time in dcp.async_save +
GdsckptWriter goes; DCP's background CPU per save, default planner against cached plans
(bench/results/: 2026-11-23-h200x2-contention/, 2026-11-23-cpu-dcp-background/, 2026-11-23-cpu-dcp-
overlap/).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver

import gdsckpt
from gdsckpt.bench import ranks, states, train_loop, train_methods
from gdsckpt.writing.snapshot.overlap import memory_of, optimizer_memory
from gdsckpt.dcp import CachedSavePlanner, GdsckptWriter
from gdsckpt.dcp.staging import snapshot_state_dict


def step(model, opt, batches, device):
    return train_loop.train_step(model, opt, batches, device, train_methods.NoCheckpoint(), [0.0, 0.0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpt2-large")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, help="override the size's layer count (the tensor count, on the CPU)")
    args = ap.parse_args()
    if args.layers:
        train_loop.TRAIN_SIZES[args.size] = (args.layers,) + train_loop.TRAIN_SIZES[args.size][1:]
    rk, device = ranks.from_env(args.device)
    model, _, windows, _ = train_loop.build(args.size, device)
    opt = ranks.shard(model)
    batches = train_loop.Batches(windows, train_loop.TRAIN_SIZES[args.size][-1], device)
    for _ in range(3):
        step(model, opt, batches, device)
    directory = rk.shared_directory(os.environ.get("BENCH_DIR"))[0]
    out = {k: [] for k in ("state_s", "stage_s", "stand_in_s", "save_s", "save_stages", "async_s", "async_done_s",
                           "save_async_s", "save_async_done_s", "overlap_walk_s", "overlap_async_s",
                           "overlap_staged_s")}

    for i in range(args.repeats + 1):  # the first round warms pools and codecs: dropped
        step(model, opt, batches, device)
        t0 = time.perf_counter()
        state = ranks.checkpoint_state(model, opt)
        t1 = time.perf_counter()
        w = GdsckptWriter(os.path.join(directory, f"stage-{i}"))
        w.stage(state)
        t2 = time.perf_counter()
        staged, w._staged[0] = w._staged[0], None  # a probe: the staging itself, dropped unwritten
        snap = staged.stats
        staged.drop()
        step(model, opt, batches, device)
        state = ranks.checkpoint_state(model, opt)
        t3 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=GdsckptWriter(os.path.join(directory, f"async-{i}")),
                             process_group=rk.group)
        t4 = time.perf_counter()
        fut.result()
        t5 = time.perf_counter()
        step(model, opt, batches, device)
        local = states.local_tensors(state)
        t6 = time.perf_counter()
        f2 = gdsckpt.save_async(local, os.path.join(directory, f"plain-{rk.rank}-{i}.gdsckpt"))
        t7 = time.perf_counter()
        f2.result()
        t8 = time.perf_counter()
        step(model, opt, batches, device)
        state = ranks.checkpoint_state(model, opt)
        t9 = time.perf_counter()
        guarded = optimizer_memory(opt)
        snapshot_state_dict(state, keep=lambda t: memory_of(t) in guarded)
        t10 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=GdsckptWriter(os.path.join(directory, f"overlap-{i}"), optimizer=opt),
                              process_group=rk.group)
        t11 = time.perf_counter()
        resp.staging_completion.result()
        t12 = time.perf_counter()
        resp.upload_completion.result()
        if i == 0:
            continue
        out["overlap_walk_s"].append(t10 - t9)
        out["overlap_async_s"].append(t11 - t10)
        out["overlap_staged_s"].append(t12 - t10)
        out["state_s"].append(t1 - t0)
        out["stage_s"].append(t2 - t1)
        out["save_s"].append(snap.seconds)
        out["stand_in_s"].append(t2 - t1 - snap.seconds)
        out["save_stages"].append({k: round(v, 4) for k, v in snap.stages.items()})
        out["async_s"].append(t4 - t3)
        out["async_done_s"].append(t5 - t3)
        out["save_async_s"].append(t7 - t6)
        out["save_async_done_s"].append(t8 - t6)
    out["logical_bytes"] = snap.logical_bytes
    out["stored_bytes"] = snap.stored_bytes
    out["tensors"] = len(local)

    if rk.rank == 0:
        prof = cProfile.Profile()
    step(model, opt, batches, device)
    rk.barrier()
    if rk.rank == 0:
        prof.enable()
    state = ranks.checkpoint_state(model, opt)
    fut = dcp.async_save(state, storage_writer=GdsckptWriter(os.path.join(directory, "profiled")),
                         process_group=rk.group)
    if rk.rank == 0:
        prof.disable()
    fut.result()
    if rk.rank == 0:
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            print(f"== rank 0, get_state_dict + dcp.async_save, by {key}\n{s.getvalue()}")

    out["background"] = background_cpu(model, opt, batches, device, directory, rk, args.repeats)
    everyone = rk.gather(out)
    if rk.rank == 0:
        res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "size": args.size, "world_size": rk.world, "ranks": everyone}
        for r, o in enumerate(everyone):
            print(f"rank {r}: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in o.items()
                                            if isinstance(v, list) and v and isinstance(v[0], float)))
            print(f"rank {r} save stages: {o['save_stages'][-1]}")
            for name, b in o["background"].items():
                print(f"rank {r} DCP background thread, {name} planner: CPU s {b['cpu_s']}, wall s {b['wall_s']}")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "dcp_stage_profile.json"), "w") as f:
                json.dump(res, f, indent=1)
    rk.close()


def background_cpu(model, opt, batches, device, directory, rk, repeats) -> dict:
    """CPU seconds of DCP's background thread per dcp.async_save, per planner (the first save
    of each, which fills the plan cache, dropped)."""
    saver, record = state_dict_saver.save, {}

    def timed_save(*args, **kwargs):  # runs in DCP's background thread (it imports save per call)
        prof = cProfile.Profile() if record.get("profile") else None
        t, c = time.perf_counter(), time.thread_time()
        if prof:
            prof.enable()
        try:
            return saver(*args, **kwargs)
        finally:
            if prof:
                prof.disable()
                record["stats"] = prof
            record["cpu"].append(time.thread_time() - c)
            record["wall"].append(time.perf_counter() - t)

    result = {}
    state_dict_saver.save = timed_save
    try:
        for name, planner in (("default", lambda: None), ("cached", lambda: CachedSavePlanner(cache_key="probe"))):
            record.update(cpu=[], wall=[])
            for i in range(repeats + 1):
                record["profile"] = name == "cached" and i == repeats and rk.rank == 0
                step(model, opt, batches, device)
                state = ranks.checkpoint_state(model, opt)
                dcp.async_save(state, storage_writer=GdsckptWriter(os.path.join(directory, f"bg-{name}-{i}")),
                               process_group=rk.group, planner=planner()).result()
            result[name] = {"cpu_s": [round(x, 4) for x in record["cpu"][1:]],
                            "wall_s": [round(x, 4) for x in record["wall"][1:]]}
    finally:
        state_dict_saver.save = saver
    if rk.rank == 0:
        s = io.StringIO()
        pstats.Stats(record["stats"], stream=s).sort_stats("tottime").print_stats(25)
        print(f"== rank 0, DCP's background thread, cached planner, by tottime\n{s.getvalue()}")
    return result


if __name__ == "__main__":
    main()
