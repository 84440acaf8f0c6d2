"""Does a background disk write slow a training loop by itself, without gdsckpt?

    OUT=dir python bench/probes/write_interference.py [--size gpt2-medium] [--gb 4]

--train shows every background method's later steps (4-40 after a checkpoint, while the file is
written) slower than the 'none' loop's. Here the bench's GPT trains while one thread does, in turn:
  idle         nothing (the baseline)
  direct       O_DIRECT pwrite of --gb GB from pinned memory in 64 MiB blocks, then fsync
               (what gdsckpt's pool writer does, without gdsckpt)
  buffered     the same through the page cache, then fsync
  devnull      the same writes to /dev/null (the syscalls and the GIL hand-offs, no disk)
  spin         a pure-Python busy loop (the GIL contended all the time, for scale)
Per case: mean step time while the writer runs against idle, and the writer's GB/s.
Writes write_interference.json.
"""
import argparse, json, os, statistics, sys, tempfile, threading, time
from pathlib import Path
import torch
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))
from idle_trace import step, warm_loop  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="gpt2-medium")
ap.add_argument("--gb", type=float, default=4)
args = ap.parse_args()
model, opt, batches, info = warm_loop(args.size)
BLOCK = 64 << 20
n = int(args.gb * 1e9) // BLOCK * BLOCK
pinned = torch.empty(BLOCK, dtype=torch.uint8, pin_memory=True).random_(0, 255)
view = memoryview(pinned.numpy())
d = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))


def writer(case, done):
    t = time.perf_counter()
    if case == "spin":
        while time.perf_counter() - t < 2.0:
            pass
    elif case != "idle":
        path = "/dev/null" if case == "devnull" else str(d / "w")
        flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if case != "devnull" else 0) | (os.O_DIRECT if case == "direct" else 0)
        fd = os.open(path, flags, 0o644)
        for off in range(0, n, BLOCK):
            os.pwritev(fd, [view], off if case != "devnull" else 0)
        if case != "devnull":
            os.fsync(fd)
        os.close(fd)
    done.append(time.perf_counter() - t)


res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "model": info, "cases": {}}
for case in ("idle", "direct", "buffered", "devnull", "spin", "idle", "direct"):
    done, times = [], []
    th = threading.Thread(target=writer, args=(case, done))
    th.start()
    while th.is_alive() or len(times) < 10:
        t = time.perf_counter()
        step(model, opt, batches)
        times.append(time.perf_counter() - t)
        if len(times) > 60:
            break
    th.join()
    row = {"steps": len(times), "step_ms_mean": round(statistics.mean(times) * 1e3, 2),
           "step_ms_median": round(statistics.median(times) * 1e3, 2), "writer_s": round(done[0], 3),
           "writer_gbps": round(n / done[0] / 1e9, 2) if case not in ("idle", "spin") else None}
    res["cases"].setdefault(case, []).append(row)
    print(case, json.dumps(row), flush=True)
    for f in d.iterdir():
        f.unlink()
Path(os.environ.get("OUT", "."), "write_interference.json").write_text(json.dumps(res, indent=1))
