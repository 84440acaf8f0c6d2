"""How long does a gdsckpt snapshot hold the GIL? (issue 13: overlap mode on a GPU)

An overlapped snapshot (save_async(overlap=True), GdsckptWriter(optimizer=)) runs on a thread
beside the training thread, which needs the GIL to launch its forward and backward. A ticker
thread wakes every 1 ms and records how late each wake-up was: a late wake-up is time some
other thread held the GIL (beyond the interpreter's 5 ms switch interval, a C call that did not
let go). Phases, each on the same fp32 state (random normal bytes, not zeros, 256 MiB chunks):

  encode-held:     nvCOMP ANS encode per chunk, its size read from result.buffer_sizes at once
                   (nvCOMP's wait: how gdsckpt 3df2ffd and earlier waited);
  encode-released: the same after cupy's stream.synchronize() (what gdsckpt does now);
  save_async:      gdsckpt.save_async's whole host snapshot (the call), then its write.

Per phase: seconds, the ticker's longest stall and the sum of stalls beyond 5 ms (GIL held by
the phase). Writes $OUT/gil_hold.json. Run: python3 bench/probes/gil_hold.py [--gb 4]
"""
import argparse
import json
import os
import tempfile
import threading
import time

import cupy
import torch
from nvidia import nvcomp

import gdsckpt
from gdsckpt.engine.gpu.codecs import NvcompCodecs

CHUNK = 256 << 20


class Ticker:
    """Wakes every `period` s; a wake-up later than `period` + 5 ms is counted as a stall."""

    def __init__(self, period=0.001):
        self.period, self.late, self.stop = period, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(self.period)
            self.late.append(time.perf_counter() - t - self.period)

    def window(self):
        start = len(self.late)
        return lambda: [x for x in self.late[start:]]


class NvcompWaitsHoldingTheGil:
    """The codec stream as NvcompCodecs sees it, minus the GIL-free wait: encode then reads the
    sizes straight from nvCOMP, which waits for the GPU holding the GIL."""

    def __init__(self, stream):
        self.ptr = stream.ptr

    def synchronize(self):
        pass


def phase(ticker, name, fn, out):
    torch.cuda.synchronize()
    lates = ticker.window()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    late = lates()
    stalls = [x for x in late if x > 0.005]
    out[name] = {"seconds": round(seconds, 4), "longest_stall_s": round(max(late, default=0.0), 4),
                 "stalled_s": round(sum(stalls), 4), "stalls": len(stalls), "ticks": len(late)}
    print(f"{name:<16} {seconds:7.3f} s  longest stall {out[name]['longest_stall_s'] * 1e3:7.1f} ms  "
          f"stalled {out[name]['stalled_s']:6.3f} s in {len(stalls)} stalls", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--directory", default="/tmp/gil-hold")
    args = ap.parse_args()
    torch.manual_seed(0)
    n = int(args.gb * (1 << 30)) // 4
    state = {f"t{i}": torch.randn(min(CHUNK // 4, n - i * (CHUNK // 4)), device="cuda")
             for i in range((n + CHUNK // 4 - 1) // (CHUNK // 4))}
    chunks = [cupy.asarray(t).view(cupy.uint8) for t in state.values()]
    stream = cupy.cuda.Stream(non_blocking=True)
    spec = {"name": "ans", "data_type": "<f4"}
    out_buf = cupy.empty(2 * CHUNK, dtype=cupy.uint8)
    released = NvcompCodecs(stream, torch.cuda.current_device())
    held = NvcompCodecs(stream, torch.cuda.current_device())
    held._stream = NvcompWaitsHoldingTheGil(stream)

    def encode_all(codecs):
        def run():
            for c in chunks:
                codecs.encode(spec, c, out_buf[:codecs.max_stored(spec, c.nbytes)], out_buf)
        return run

    encode_all(released)()  # warm-up: codec set-up, CuPy pools
    encode_all(held)()
    ticker = Ticker()
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
              "nvcomp": nvcomp.__version__, "state_bytes": n * 4, "chunk_bytes": CHUNK, "phases": {}}
    for rep in range(3):
        phase(ticker, f"encode-held-{rep}", encode_all(held), result["phases"])
        phase(ticker, f"encode-released-{rep}", encode_all(released), result["phases"])
    os.makedirs(args.directory, exist_ok=True)
    path = tempfile.mktemp(dir=args.directory, suffix=".gdsckpt")
    for rep in range(3):
        futs = []
        phase(ticker, f"save_async-{rep}", lambda: futs.append(gdsckpt.save_async(state, path)), result["phases"])
        phase(ticker, f"write-{rep}", lambda: futs[0].result(), result["phases"])
        result["io_path"] = futs[0].result().io_path
    ticker.stop.set()
    dest = os.environ.get("OUT", ".")
    with open(os.path.join(dest, "gil_hold.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
