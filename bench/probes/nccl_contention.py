"""Does checkpoint I/O slow a 2-GPU training step through the host? (issue 13, 2x H200)

Under torchrun, one rank per GPU. Times, each phase ~4 s:
  nccl: all_gather_into_tensor of 256 MiB per rank (FSDP2's parameter all-gather), bus GB/s;
  mm:   a bf16 matmul loop (compute only), ms per iteration;
  launch: 2,000 tiny kernels launched from Python then a sync, us per launch (what an FSDP2
        step's CPU side is made of: the GIL and the CPU show here, the disk's DMA does not);
alone, then while a thread in each rank writes a pinned 1 GiB buffer to a file with O_DIRECT
at full speed (what gdsckpt's background writer does), the same paced to PACED_GBPS per rank
(does a slower write hurt less than in proportion?), buffered writes through the page cache
(what DCP's FileSystemWriter does), then while a side stream copies device-to-host into pinned
memory (what a staging copy does). If nccl slows under the writes and mm does not, the
collectives share a path with the disk's DMA (host memory / PCIe: NCCL over SHM or PCIe P2P,
not NVLink); if launch slows, the CPU side does (per phase, the host's CPU time split from
/proc/stat shows system, irq and, in a VM, steal time). Run with NCCL_DEBUG=INFO to see the
transport. Writes $OUT/nccl_contention.json.
"""
import json
import os
import threading
import time

import torch
import torch.distributed as dist

PHASE_S = 4.0
PACED_GBPS = 0.4
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times():
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:1 + len(CPU_FIELDS)]]


def cpu_split(before, after):
    """Share of the host's CPU time per /proc/stat field over a phase."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return {k: round(v / total, 4) for k, v in zip(CPU_FIELDS, d)}


def sync():
    """This stream only: a device-wide synchronize would also wait for the D2H phase's copies
    on their side stream and charge them to the timed loop."""
    torch.cuda.current_stream().synchronize()


def bench_nccl(stop_after):
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n * dist.get_world_size(), dtype=torch.uint8, device="cuda")
    dist.all_gather_into_tensor(dst, src)
    sync()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < stop_after:
        dist.all_gather_into_tensor(dst, src)
        k += 1
        if k % 4 == 0:
            sync()
    sync()
    dt = time.perf_counter() - t0
    w = dist.get_world_size()
    return k * n * (w - 1) / dt / 1e9  # bus bandwidth of an all-gather


def bench_launch(stop_after):
    x = torch.zeros(16, device="cuda")
    sync()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < stop_after:
        for _ in range(2000):
            x.add_(1)
        sync()
        k += 2000
    return (time.perf_counter() - t0) / k * 1e6


def bench_mm(stop_after):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sync()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < stop_after:
        a @ a
        k += 1
        if k % 8 == 0:
            sync()
    sync()
    return (time.perf_counter() - t0) / k * 1e3


class Writer(threading.Thread):
    """Writes a 1 GiB pinned buffer over and over in 64 MiB pieces: O_DIRECT or buffered (then
    fsync'd each pass), at full speed or paced to `gbps`."""

    def __init__(self, path, direct=True, gbps=None):
        super().__init__(daemon=True)
        self.buf = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.buf.random_(0, 256)
        self.path, self.direct, self.rate = path, direct, gbps
        self.stop, self.bytes = threading.Event(), 0

    def run(self):
        flags = os.O_WRONLY | os.O_CREAT
        try:
            fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError:  # no O_DIRECT on this file system
            fd, self.direct = os.open(self.path, flags, 0o644), False
        mv = memoryview(self.buf.numpy())
        t0 = time.perf_counter()
        try:
            while not self.stop.is_set():
                for off in range(0, len(mv), 64 << 20):
                    self.bytes += os.pwrite(fd, mv[off:off + (64 << 20)], off)
                    if self.rate:  # sleep until the schedule catches up with the bytes written
                        ahead = self.bytes / (self.rate * 1e9) - (time.perf_counter() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
                    if self.stop.is_set():
                        break
                if not self.direct:
                    os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(self.path)
        self.gbps = self.bytes / (time.perf_counter() - t0) / 1e9


class D2H(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.stream, self.stop, self.bytes = torch.cuda.Stream(), threading.Event(), 0

    def run(self):
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.bytes += self.src.nbytes
        self.gbps = self.bytes / (time.perf_counter() - t0) / 1e9


def phase(name, bg):
    if bg is not None:
        bg.start()
        time.sleep(0.3)
    dist.barrier()
    before = cpu_times()
    r = {"nccl_busbw_gbps": bench_nccl(PHASE_S), "mm_ms": bench_mm(PHASE_S / 2),
         "launch_us": bench_launch(PHASE_S / 2)}
    r["host_cpu"] = cpu_split(before, cpu_times())
    if bg is not None:
        bg.stop.set()
        bg.join()
        r["background_gbps"] = getattr(bg, "gbps", None)
    dist.barrier()
    return name, r


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    scratch = os.environ.get("BENCH_DIR", "/tmp/bench")
    os.makedirs(scratch, exist_ok=True)
    out = dict([phase("alone", None),
                phase("while O_DIRECT writes from pinned memory", Writer(f"{scratch}/contention-{rank}")),
                phase(f"while O_DIRECT writes paced to {PACED_GBPS} GB/s per rank",
                      Writer(f"{scratch}/contention-{rank}", gbps=PACED_GBPS)),
                phase("while buffered writes + fsync", Writer(f"{scratch}/contention-{rank}", direct=False)),
                phase("while D2H copies into pinned memory", D2H()),
                phase("alone again", None)])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    if rank == 0:
        res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
               "world_size": dist.get_world_size(), "ranks": everyone}
        print(json.dumps(res, indent=1))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "nccl_contention.json"), "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
