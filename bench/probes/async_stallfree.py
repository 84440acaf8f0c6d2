"""save_async's compressed host snapshot on the realistic 4 GB state (issue 13): per save, the
caller's blocked seconds, the background write's seconds against a synchronous save of the same
state, the pool's pinned bytes against the stored bytes, extra GPU memory against the ring, and
bit-exactness of every file although every tensor is overwritten right after save_async returns.
No training loop runs here (gdsckpt-bench --train measures that). Modes: the default (ROUNDS
saves, default 5: the first allocates the pool), overlap=True (an AdamW over the fp32 master
weights; the step right after the call waits for the snapshot; the other tensors, which that
optimizer does not own, are copied by the call), snapshot="device". Checkpoints go to
$BENCH_DIR (default /tmp/bench). JSON to $OUT/async-stallfree.json. STATE_SIZE (default 4GB)
and STATE_DEVICE (default cuda) allow a dry run on the CPU ("tiny", "cpu")."""

import gc
import json
import os
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt.bench.workload import make_state

OUT = Path(os.environ.get("OUT", "."))
DIR = Path(os.environ.get("BENCH_DIR", "/tmp/bench")) / "async-stallfree"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
DIR.mkdir(parents=True, exist_ok=True)
for p in DIR.iterdir():
    p.unlink()


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def flip(state):
    """Overwrite every byte of every tensor, queued on the current stream (training would)."""
    for t in tensors(state):
        if t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()


def same(a, b) -> bool:
    ta, tb = list(tensors(a)), list(tensors(b))
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape
                                      and torch.equal(x.reshape(-1).view(torch.uint8).to(y.device),
                                                      y.reshape(-1).view(torch.uint8)) for x, y in zip(ta, tb))


def fields(s) -> dict:
    keep = ("mode", "blocked_s", "hook_wait_s", "snapshot_s", "queued_s", "background_s", "write_s", "fsync_s",
            "commit_s", "seconds", "io_path", "direct_io", "logical_bytes", "stored_bytes", "file_bytes", "chunks",
            "pool_bytes", "pool_peak_bytes", "pool_limit_bytes", "pool_waits", "pool_wait_s", "pool_alloc_s")
    d = {k: getattr(s, k) for k in keep if hasattr(s, k)}
    d["memory"] = s.memory
    d["stages"] = {k: round(v, 4) for k, v in s.stages.items()}
    if getattr(s, "pool_bytes", 0):
        d["pool_over_stored"] = s.pool_bytes / s.stored_bytes
    return d


CUDA = os.environ.get("STATE_DEVICE", "cuda") == "cuda"
if not CUDA:  # a dry run: the CUDA calls below become no-ops
    torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = torch.cuda.empty_cache = lambda *a: None
    torch.cuda.mem_get_info = lambda *a: (0, 0)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0
    torch.cuda.get_device_name = lambda *a: "cpu"
t = time.perf_counter()
state = make_state(os.environ.get("STATE_SIZE", "4GB"), device="cuda" if CUDA else "cpu")
out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "torch": torch.__version__, "gdsckpt": gdsckpt.__version__, "dir": str(DIR),
       "state_build_s": time.perf_counter() - t}
want = {"copy": [t.clone() for t in tensors(state)]}  # the state at the moment of each call
torch.cuda.synchronize()
gc.collect()

# the synchronous save, for the background write's yardstick (disk time of the same bytes)
sync = []
for i in range(2):
    s = gdsckpt.save(state, DIR / f"sync{i}.gdsckpt")
    sync.append({"seconds": s.seconds, "stored_bytes": s.stored_bytes, "io_path": s.io_path})
    (DIR / f"sync{i}.gdsckpt").unlink()
out["sync_save"] = sync
print("sync save", [round(r["seconds"], 3) for r in sync], "s", flush=True)


def async_round(name, path, check=True, **kw):
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()
    alloc0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fut = gdsckpt.save_async(state, path, **kw)
    call = time.perf_counter() - t0
    hook = None
    if kw.get("overlap"):
        t1 = time.perf_counter()
        kw["optimizer"].step()  # the pre-hook waits for the snapshot
        hook = time.perf_counter() - t1
    flip(state)  # training overwrites everything right after the call (the step, in overlap mode)
    free1 = torch.cuda.mem_get_info()[0]
    s = fut.result()
    row = {"name": name, "call_s": call, "step_wait_s": hook, **fields(s),
           "torch_peak_extra_bytes": torch.cuda.max_memory_allocated() - alloc0,
           "device_free_drop_bytes": free0 - free1}
    flip(state)  # back to the state as it was
    if check:
        loaded = gdsckpt.load(path)
        row["bit_exact"] = same(want["copy"], loaded)
        del loaded
    out.setdefault("rounds", []).append(row)
    print(f"{name}: blocked {s.blocked_s:.3f} s (call {call:.3f}), snapshot {s.snapshot_s:.3f}, "
          f"background {s.background_s:.3f} s, pool {s.pool_bytes / 1e9:.2f} GB / stored {s.stored_bytes / 1e9:.2f} GB, "
          f"waits {s.pool_waits}, peak extra GPU {s.memory.get('peak_extra_gpu_bytes', 0) / 2**20:.0f} MiB "
          f"(ring {s.memory.get('ring_gpu_bytes', 0) / 2**20:.0f} MiB), {s.io_path}, "
          f"bit-exact {row.get('bit_exact')}", flush=True)
    torch.cuda.empty_cache()
    return s


for i in range(ROUNDS):
    async_round(f"default #{i + 1}", DIR / f"async{i}.gdsckpt")

master = [p for p in tensors(state["master"]) if p.is_floating_point()]
params = [torch.nn.Parameter(p) for p in master]  # shares memory with the state's master weights
opt = torch.optim.AdamW(params)  # no grads: its step changes nothing but runs its hooks
async_round("overlap", DIR / "overlap.gdsckpt", overlap=True, optimizer=opt)
async_round("snapshot=device", DIR / "device.gdsckpt", snapshot="device")
out["pools"] = gdsckpt.writing.async_save.pools()

rows = out["rounds"]
steady = [r for r in rows if r["name"].startswith("default") and r["name"] != "default #1"]
out["summary"] = {
    "blocked_s_default_steady": [r["blocked_s"] for r in steady],
    "blocked_s_default_first": rows[0]["blocked_s"],
    "background_over_sync": [r["background_s"] / min(x["seconds"] for x in sync) for r in steady],
    "pool_over_stored": [r.get("pool_over_stored") for r in steady],
    "all_bit_exact": all(r.get("bit_exact", True) for r in rows),
}
print(json.dumps(out["summary"], indent=1))
(OUT / "async-stallfree.json").write_text(json.dumps(out, indent=1, default=str))
