"""gdsckpt-bench --train's model and loop: a GPT trained with AdamW, checkpointed by one method
every `interval` steps, and what one such loop measured (Loop).

The model is workload.GPT (a plain nn.Module), under bf16 autocast on a GPU and bf16 matmuls
emulated on the CPU (workload.Bf16Matmuls). A loop times every step, every checkpoint call
(blocked: the call plus any wait the method imposes before the next optimizer step) and its
completion (call to durable), and drains the last checkpoint inside the timed loop, so that a
method's whole cost is in the loop's time. Memory: torch's peak GPU allocation, device-wide free
memory (cudaMemGetInfo, every step: it also sees nvCOMP/CuPy/KvikIO allocations), torch's pinned
host memory and the process's peak RSS over its start.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .train_methods import Ctx, Method
from .workload import GPT, Bf16Matmuls, token_windows


# name: layers, heads, d_model, vocab, context, seq, batch
TRAIN_SIZES = {
    "tiny": (2, 4, 128, 256, 64, 64, 4),            # ~0.5M params: CI
    # ~1.9M params, ~23 MB of state; 2 x 32 tokens a step: the CPU's default, its steps short, so
    # that the default run (five methods, two repeats) takes about 2 minutes on 2 busy cores
    "small-cpu": (4, 4, 192, 256, 128, 32, 2),
    "gpt2-small": (12, 12, 768, 50257, 1024, 1024, 8),
    # GPT-2 medium's shapes with an untied head: 406M params, fp32 + AdamW = 4.87 GB of state.
    "gpt2-medium": (24, 16, 1024, 50257, 1024, 1024, 8),
    # GPT-2 large's shapes, untied head: 838M params, 10.1 GB of state (5.0 GB per rank on two GPUs).
    "gpt2-large": (36, 20, 1280, 50257, 1024, 1024, 8),
}


STEPS, INTERVAL = 120, 40  # a loop's steps and checkpoint interval: a GPU's, or any given one of them


def build(size: str, device: str):
    layers, heads, d, vocab, ctxlen, seq, batch = TRAIN_SIZES[size]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(layers, heads, d, vocab, ctxlen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    windows = token_windows(vocab, seq)
    info = {"size": size, "layers": layers, "heads": heads, "d_model": d, "vocab": vocab, "seq": seq,
            "batch": batch, "params": sum(p.numel() for p in model.parameters())}
    return model, opt, windows, info


class Batches:
    def __init__(self, windows, batch, device):
        self.w, self.batch, self.device, self.i = windows, batch, device, 0
        g = torch.Generator().manual_seed(1)
        self.order = torch.randperm(len(windows), generator=g)

    def next(self):
        idx = self.order[torch.arange(self.i, self.i + self.batch) % len(self.order)]
        self.i += self.batch
        return self.w[idx].to(self.device, non_blocking=True)


def train_step(model, opt, batches, device, method: Method, hook_t: list, sync: bool = True):
    """One step; sync: the host reads the loss (loss.item(), waiting for the GPU), as a loop that
    logs its loss every step does. Returns (loss or None, the optimizer step's wait, loss.item()'s wait)."""
    idx = batches.next()
    cuda = device.startswith("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else Bf16Matmuls():
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t = time.perf_counter()
    method.before_step()
    waited = time.perf_counter() - t
    hook_t[1] = 0.0
    opt.step()
    if not sync:  # the host runs ahead of the GPU, as far as CUDA's launch queue lets it
        return None, waited + hook_t[1], 0.0
    t = time.perf_counter()
    value = loss.item()  # the loop logs its loss here; the host waits for the GPU
    return value, waited + hook_t[1], time.perf_counter() - t


def synced_step(step: int, sync_every: int) -> bool:
    """Whether the loop reads its loss after `step` (1-based): every `sync_every`-th step, as a
    loop that logs every N steps and checkpoints at a multiple of N (Hugging Face's Trainer logs,
    then saves). Every run of steps the estimates sum (train_report: multiples of interval // 4)
    then ends with a sync, and the steps between run ahead of the GPU."""
    return step % sync_every == 0


def n_checkpoints(steps: int, interval: int) -> int:
    """Checkpoints at steps interval, 2 x interval, ... with a full interval of training after
    each (a loop of 120 steps at interval 40 checkpoints at 40 and 80): the last one gets as
    long to finish in the background as the others, as in a long run; whatever it still needs
    after that is drained inside the timed loop (drain_s)."""
    return max(0, steps // interval - 1 if steps % interval == 0 else steps // interval)


KEEP = 2  # checkpoints a loop keeps on disk, as a run's retention would: older ones are deleted


class Retention:
    """Deletes each checkpoint once KEEP newer ones are durable, on a thread of its own (never
    the training thread's time), so that long loops fit the disk; `join` waits for the deletions."""

    def __init__(self):
        self.paths: list[Path] = []
        self.threads: list[threading.Thread] = []

    def saved(self, path: Path, handle) -> None:
        self.paths.append(path)
        if len(self.paths) > KEEP:
            self._delete(self.paths[-KEEP - 1], handle)

    def _delete(self, path: Path, after) -> None:
        """Delete `path` once `after` (the newest save's handle, or None) is done, on a thread
        started now: `join` then waits for every deletion. (A thread started by `after`'s done
        callback could start after `join`, as callbacks run after result() returns, and race the
        next loop's clearing of the directory.)"""
        def run():
            if after is not None:
                try:
                    after.result()
                except Exception:  # the loop reports the save's error; the old file goes either way
                    pass
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        t = threading.Thread(target=run, name="bench-retention", daemon=True)
        self.threads.append(t)
        t.start()

    def join(self) -> None:
        for t in list(self.threads):
            t.join()


def _rss_reset():
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_bytes(field: str) -> int:
    """A kB field of /proc/self/status in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss_peak() -> int:
    return _status_bytes("VmHWM")


def _rss() -> int:
    return _status_bytes("VmRSS")


def _steal_s() -> float | None:
    """CPU seconds the hypervisor has so far run something else on this VM's CPUs while they
    wanted to run (/proc/stat's steal, all CPUs); None where there is no such figure. The H100
    VMs' step times drift with it (bench/results/2026-11-24-h100-steal/)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def _pinned_torch() -> int:
    try:
        s = torch.cuda.host_memory_stats()
        return int(s.get("allocated_bytes.peak", s.get("reserved_bytes.peak", 0)))
    except Exception:
        return 0


@dataclass
class Loop:
    seconds: float
    blocked: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # each checkpoint call's own seconds (blocked, less the optimizer's wait)
    completion: list = field(default_factory=list)
    peak_torch: int = 0
    peak_device: int = 0
    pinned: int = 0
    rss_extra: int = 0
    drain: float = 0.0
    steps: list = field(default_factory=list)  # each training step's seconds (the saves apart)
    ckpt_steps: list = field(default_factory=list)  # the steps a checkpoint followed
    gpu_waits: list = field(default_factory=list)  # of each step, the seconds loss.item() waited for the GPU
    steal_s: float | None = None  # CPU seconds the hypervisor took from this VM's CPUs during the loop (_steal_s)
    steal_windows: list = field(default_factory=list)  # the same over each `interval` steps, every loop alike


def run_loop(ctx: Ctx, method: Method, batches, steps: int, interval: int, tag: str, sync_every: int = 1,
             on_step=None) -> Loop:
    """One timed loop of `steps` steps, `method` checkpointing every `interval`; on_step(step)
    after each step (the progress line: a few microseconds)."""
    cuda = ctx.device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
        free0 = min_free = torch.cuda.mem_get_info()[0]
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except Exception:
            pass
    rss0 = _rss()
    _rss_reset()
    # A step pre-hook that save_async(..., optimizer=opt) installs makes opt.step() wait (as does
    # the one a default save_async or gdsckpt.dcp.async_save installs where it finds the optimizer
    # that fences the state): ours, registered first, stamps the time (hook_t[0]); a second one,
    # registered after each save (so after the library's), adds the time since then to the
    # step's wait (hook_t[1]).
    hook_t = [0.0, 0.0]
    hooks = getattr(method, "with_opt", False) or method.asynchronous
    waits = hooks or type(method).before_step is not Method.before_step
    first = ctx.opt.register_step_pre_hook(lambda *a: hook_t.__setitem__(0, time.perf_counter())) if hooks else None
    last = None

    def after(*a):
        hook_t[1] += time.perf_counter() - hook_t[0]
    blocked, calls, done_at, started = [], [], {}, []
    pending = []
    retention = Retention()
    steal0 = _steal_s()
    steal_marks = [steal0]
    t0 = time.perf_counter()
    step_s, ckpt_steps, gpu_waits = [], [], []
    for step in range(1, steps + 1):
        ts = time.perf_counter()
        _, waited, gpu_wait = train_step(ctx.model, ctx.opt, batches, ctx.device, method, hook_t,
                                         synced_step(step, sync_every))
        step_s.append(time.perf_counter() - ts)
        gpu_waits.append(gpu_wait)
        if blocked and waits:
            blocked[-1] += waited  # the wait the last checkpoint imposed on this optimizer step
        if cuda:
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
        if step % interval == 0 and steal0 is not None:
            steal_marks.append(_steal_s())
        if on_step is not None:
            on_step(step)
        if method.name != "none" and step % interval == 0 and step <= steps - interval:
            path = ctx.directory / f"{tag}-step{step}"
            tc = time.perf_counter()
            handle = method.save(ctx, ctx.state(), path)
            te = time.perf_counter()
            blocked.append(te - tc)
            calls.append(te - tc)
            started.append(tc)
            ckpt_steps.append(step)
            i = len(started) - 1
            if handle is None:
                done_at[i] = te
            else:
                handle.add_done_callback(lambda f, i=i: done_at.__setitem__(i, time.perf_counter()))
                pending.append(handle)
            retention.saved(path, handle)
            if hooks:
                if last is not None:
                    last.remove()
                last = ctx.opt.register_step_pre_hook(after)
            if cuda:
                min_free = min(min_free, torch.cuda.mem_get_info()[0])
    td = time.perf_counter()
    for h in pending:  # drained inside the timed loop
        h.result()
    method.before_step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    drain = time.perf_counter() - td
    deadline = time.perf_counter() + 5  # result() can return before the done callbacks have run
    while len(done_at) < len(started) and time.perf_counter() < deadline:
        time.sleep(0.001)
    retention.join()
    if first is not None:
        first.remove()
    if last is not None:
        last.remove()
    loop = Loop(seconds, blocked, calls, [done_at[i] - started[i] for i in range(len(started)) if i in done_at], drain=drain,
                steps=step_s, ckpt_steps=ckpt_steps, gpu_waits=gpu_waits)
    steal1 = _steal_s()
    if steal0 is not None and steal1 is not None:
        loop.steal_s = round(steal1 - steal0, 2)
        loop.steal_windows = [round(b - a, 2) for a, b in zip(steal_marks, steal_marks[1:])]
    if cuda:
        loop.peak_torch = torch.cuda.max_memory_allocated() - base_alloc
        loop.peak_device = free0 - min_free
        loop.pinned = _pinned_torch()
    loop.rss_extra = max(0, _rss_peak() - rss0)
    return loop
