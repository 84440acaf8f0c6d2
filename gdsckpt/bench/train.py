"""gdsckpt-bench --train: what checkpointing costs a real training loop.

A GPT-shaped decoder (a plain nn.Module, workload.GPT, no Hugging Face dependency) trains with AdamW
under bf16 autocast (on the CPU: a small model, bf16 emulated as workload._Bf16Matmuls does)
and checkpoints {"model": model.state_dict(), "optim": optimizer state} every --interval steps.
Every method runs the same loop of --steps steps; the last checkpoint's background write is
drained inside the timed loop, so a method's whole cost is in its loop time:

  loop overhead per checkpoint = (loop seconds - the 'none' loop's seconds) / checkpoints

The methods' loops run interleaved (none, A, B, ..., none, A, B, ...) --repeats times, so the
noise between repeats shows. Before its first loop each method makes one checkpoint outside
the loops (codecs, pinned pools, process start-up): reported apart as `first_save`.

Per checkpoint: caller-blocked seconds (the call, plus any wait the method imposes before
the next optimizer step: DCP's staging future, a save_async step pre-hook) and background
completion (call to durable). Per loop: peak extra GPU memory over the 'none' loop (torch's
max_memory_allocated, and device-wide free memory from cudaMemGetInfo sampled every step,
which also sees nvCOMP/CuPy/KvikIO allocations), torch's pinned host memory (its caching host
allocator), and the process's peak RSS over its start (pinned pools count there once touched).

Under torchrun (`torchrun --nproc-per-node 2 -m gdsckpt.bench --train ...`) each rank trains
its FSDP2 shard and saves it through DCP (ranks.py); the one-process methods are reported as
unavailable there.

Methods are a table (METHODS): one line per method or mode. gdsckpt.save_async modes are
detected from the installed save_async's signature; a mode it does not accept is reported as
unavailable, and a method that raises is recorded with its exception, not fatal.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import ranks, targets
from .ranks import Ranks

TRAIN_SCHEMA = 1
TRAIN_SCHEMA_DOC = """--train JSON: {schema: 1, mode: "train", date, host, device: {kind, name}, versions, io_path,
 model: {size, layers, heads, d_model, vocab, seq, batch, params}, state: {logical_bytes, tensors},
 steps, interval, checkpoints_per_loop (at interval, 2 x interval, ..., each followed by a full interval),
 repeats, dcp_planner (cached | default: the DCP methods' save planner), step_s (the 'none' loops' mean),
 methods: [{name, status: ok|error|unavailable, error, loops_s: [per repeat], overhead_per_ckpt_s:
   {mean, min, max, each}, drain_s: [per repeat: the wait for the last write at the loop's end],
   blocked_s: {mean, max, each}, completion_s: {mean, max, each},
   steps_after_ckpt_extra_s: [k = 1..interval: the k-th step after a checkpoint minus the 'none' loop's median step],
   gpu_wait_after_ckpt_extra_s: [the same for the part of each step spent in loss.item() waiting for the GPU],
   overhead_in_loop_per_ckpt_s: {mean, min, max, each} (loop s - steps x the median step before its first checkpoint),
   first_save: {blocked_s, completion_s}, stored_bytes, gpu: {peak_extra_torch_bytes, peak_extra_device_bytes},
   host: {pinned_torch_bytes, pinned_gdsckpt_bytes (Stats.memory), rss_peak_extra_bytes}, notes}],
 cost: {...} | null, targets: [{method, rank, checks: {idle_s | blocked_s | extra_gpu_bytes | durable_x_sync:
   {target, measured, met, short_by}}}] (bench/targets.py);
 under torchrun (rank 0 writes it) also: world_size, model.sharding, state.per_rank_bytes,
 ranks: [{rank, methods: [{name, status, error, overhead_per_ckpt_s, blocked_s, completion_s, first_save,
   steps_after_ckpt_extra_s, gpu_wait_after_ckpt_extra_s, gpu, host, stored_bytes}]}]}"""


# name: layers, heads, d_model, vocab, context, seq, batch
TRAIN_SIZES = {
    "tiny": (2, 4, 128, 256, 64, 64, 4),            # ~0.5M params: CI
    "small-cpu": (4, 4, 192, 256, 128, 128, 4),      # ~1.9M params, ~23 MB of state
    "gpt2-small": (12, 12, 768, 50257, 1024, 1024, 8),
    # GPT-2 medium's shapes with an untied head: 406M params, fp32 + AdamW = 4.87 GB of state.
    "gpt2-medium": (24, 16, 1024, 50257, 1024, 1024, 8),
    # GPT-2 large's shapes, untied head: 838M params, 10.1 GB of state (5.0 GB per rank on two GPUs).
    "gpt2-large": (36, 20, 1280, 50257, 1024, 1024, 8),
}


# ---------------------------------------------------------------- methods


@dataclass
class Ctx:
    """What a method sees: the loop's model and optimizer, the checkpoint directory, the device."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    directory: Path
    device: str
    io_path: str | None = None
    stored_bytes: int | None = None
    pinned: int = 0  # the largest pinned_host_bytes a gdsckpt Stats reported
    ranks: Ranks | None = None  # under torchrun
    dcp_planner: str = "cached"  # every DCP method's: "cached" (gdsckpt.dcp.CachedSavePlanner) or "default"

    @property
    def group(self):
        """The process group for DCP's collectives (None: the default one)."""
        return self.ranks.group if self.ranks else None

    def planner(self, method: str):
        """The DCP save planner of a DCP method (None: DCP's DefaultSavePlanner); cached plans
        are the method's own (each stores its writer's data)."""
        if self.dcp_planner == "cached":
            from gdsckpt.dcp import CachedSavePlanner
            return CachedSavePlanner(cache_key=method)
        return None

    def state(self) -> dict:
        if self.ranks:
            return ranks.checkpoint_state(self.model, self.opt)
        return checkpoint_state(self.model, self.opt)


class Method:
    """One way to checkpoint. `save` returns a handle; `pending` futures complete in the
    background. Sync methods return None (their whole cost is the call)."""

    name = "?"
    asynchronous = False
    sharded = False  # runs under torchrun: saves each rank's DTensor shards
    notes = ""  # what the result should say about how it ran

    def available(self) -> str | None:
        """None if it can run here, else why not."""
        return None

    def setup(self, ctx: Ctx) -> None:
        pass

    def save(self, ctx: Ctx, state: dict, path: Path):
        raise NotImplementedError

    def before_step(self) -> None:
        """Called before each optimizer step (timed into blocked): wait for what must finish
        before the state may change."""

    def teardown(self) -> None:
        pass


class NoCheckpoint(Method):
    name = "none"
    sharded = True


class TorchSave(Method):
    name = "torch.save"

    def save(self, ctx, state, path):
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        ctx.stored_bytes = path.stat().st_size


class GdsSave(Method):
    name = "gdsckpt.save"

    def save(self, ctx, state, path):
        import gdsckpt
        s = gdsckpt.save(state, path)
        ctx.io_path, ctx.stored_bytes = s.io_path, s.file_bytes
        ctx.pinned = max(ctx.pinned, s.memory.get("pinned_host_bytes", 0))


class GdsSaveAsync(Method):
    asynchronous = True

    def __init__(self, name: str, kwargs: dict, optimizer: bool = False):
        self.name, self.kwargs, self.with_opt = name, kwargs, optimizer

    def available(self):
        import gdsckpt
        params = inspect.signature(gdsckpt.save_async).parameters
        want = list(self.kwargs) + (["optimizer"] if self.with_opt else [])
        missing = [k for k in want if k not in params]
        return f"save_async does not accept {', '.join(missing)}" if missing else None

    def save(self, ctx, state, path):
        import gdsckpt
        kw = dict(self.kwargs)
        if self.with_opt:
            kw["optimizer"] = ctx.opt
        fut = gdsckpt.save_async(state, path, **kw)

        def done(f):
            if f.exception() is None:
                s = f.result()
                ctx.io_path, ctx.stored_bytes = s.io_path, s.file_bytes
                ctx.pinned = max(ctx.pinned, s.memory.get("pinned_host_bytes", 0))
        fut.add_done_callback(done)
        return fut


class GdsSaveAsyncShards(GdsSaveAsync):
    """Under torchrun: each rank gdsckpt.save_async's its local shards (DTensor.to_local) to a
    file of its own, without DCP. Not a checkpoint DCP can load or reshard: it measures what
    DCP's planning and collectives add to dcp.async_save with GdsckptWriter."""

    sharded = True

    def __init__(self, overlap: bool = False):
        super().__init__("gdsckpt.save_async" + (" overlap" if overlap else "") + " per rank, no DCP",
                         {"overlap": True} if overlap else {}, optimizer=overlap)

    def available(self):
        return None if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "a comparison for runs under torchrun"

    def save(self, ctx, state, path):
        from torch.distributed.tensor import DTensor
        from .workload import _walk
        local = {k: (t.to_local() if isinstance(t, DTensor) else t) for k, t in _walk(state)}
        rank = ctx.ranks.rank if ctx.ranks else 0
        return super().save(ctx, local, path.with_name(f"{path.name}-rank{rank}.gdsckpt"))


_PG_READY = False


def _process_group() -> None:
    """DCP's async paths want a process group: one rank of gloo, set up once."""
    global _PG_READY
    import torch.distributed as dist
    if _PG_READY or dist.is_initialized():
        _PG_READY = True
        return
    store = tempfile.mktemp(prefix="gdsckpt-bench-pg-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    _PG_READY = True


class DcpPinned(Method):
    """dcp.async_save with DCP's pinned-memory DefaultStager, FileSystemWriter (fsync on).

    One stager for every save, as DCP intends (its pinned buffers are reused), except where
    staging closes it: torch 2.11's DefaultStager closes its StateDictStager after each stage
    (pytorch/pytorch#183413; a second save then fails with KeyError(<class 'type'>)), and so
    frees its pinned cache anyway. There a new stager per save is DCP's actual behaviour, and
    the result's notes say so."""

    asynchronous = True
    sharded = True

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"dcp.async_save pinned {kind}"
        self.stager = None
        self.staging = None

    def available(self):
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: F401
        except ImportError as e:
            return f"torch {torch.__version__} has no DefaultStager/AsyncCheckpointerType: {e}"
        return None

    def setup(self, ctx):
        _process_group()
        self.gpu = ctx.device.startswith("cuda")
        if not self.gpu:
            self.notes = "CPU: DefaultStager without pinned memory or non-blocking copies (they need an accelerator)"
        self.stager = self._new_stager()

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        # (pinned memory, shared memory, async staging, non-blocking copies): torchtitan's async_with_pinned_mem
        return DefaultStager(StagingOptions(self.gpu, True, True, self.gpu))

    def _closed_by_staging(self) -> bool:
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        if self._closed_by_staging():
            self.stager.close()
            self.stager = self._new_stager()
            self.notes = (f"torch {torch.__version__}: DefaultStager closes itself after staging "
                          "(pytorch/pytorch#183413), so a new one (new pinned buffers) per save")
        kind = AsyncCheckpointerType.THREAD if self.kind == "thread" else AsyncCheckpointerType.PROCESS
        r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
                           async_checkpointer_type=kind, async_stager=self.stager, process_group=ctx.group,
                           planner=ctx.planner(self.name))
        if hasattr(r, "upload_completion"):  # AsyncSaveResponse: staging runs in the background too
            self.staging = r.staging_completion
            r = r.upload_completion
        r.add_done_callback(lambda f: f.exception() is None and setattr(ctx, "stored_bytes", _dir_bytes(path)))
        return r

    def before_step(self):
        if self.staging is not None:  # the state must not change before staging has copied it
            self.staging.result()
            self.staging = None

    def teardown(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def _dir_bytes(path) -> int:
    """A DCP checkpoint's size: every rank's files and the metadata (on a shared directory)."""
    return sum(p.stat().st_size for p in Path(path).iterdir())


class DcpGdsckpt(Method):
    """dcp.async_save through GdsckptWriter's compressed staging; overlap: staged during the
    next forward/backward (GdsckptWriter(optimizer=)), the optimizer step waiting for it."""

    asynchronous = True
    sharded = True

    def __init__(self, overlap: bool = False):
        self.with_opt = overlap
        self.name = "dcp.async_save GdsckptWriter" + (" overlap" if overlap else "")

    def available(self):
        from gdsckpt.dcp import GdsckptWriter
        if self.with_opt and "optimizer" not in inspect.signature(GdsckptWriter).parameters:
            return "GdsckptWriter does not accept optimizer"
        return None

    def setup(self, ctx):
        _process_group()

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        from gdsckpt.dcp import GdsckptWriter
        w = GdsckptWriter(path, optimizer=ctx.opt) if self.with_opt else GdsckptWriter(path)
        fut = dcp.async_save(state, storage_writer=w, process_group=ctx.group, planner=ctx.planner(self.name))
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse: staging is a future

        def done(f):
            if f.exception() is None and w.last_stats is not None:
                ctx.io_path = w.last_stats.io_path
                ctx.stored_bytes = _dir_bytes(path)
        fut.add_done_callback(done)
        return fut


class DcpSave(Method):
    """dcp.save (synchronous) through FileSystemWriter (fsync on) or GdsckptWriter: the sharded
    runs' counterparts of torch.save and gdsckpt.save."""

    sharded = True

    def __init__(self, writer: str):
        self.writer = writer
        self.name = f"dcp.save {writer}"

    def setup(self, ctx):
        _process_group()

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        if self.writer == "GdsckptWriter":
            from gdsckpt.dcp import GdsckptWriter
            w = GdsckptWriter(path)
        else:
            w = dcp.FileSystemWriter(str(path), sync_files=True)
        dcp.save(state, storage_writer=w, process_group=ctx.group, planner=ctx.planner(self.name))
        ctx.stored_bytes = _dir_bytes(path)
        if getattr(w, "last_stats", None) is not None:
            ctx.io_path = w.last_stats.io_path


# One line per method or mode: adding a save_async mode is one more GdsSaveAsync line.
METHODS: list[Callable[[], Method]] = [
    NoCheckpoint,
    TorchSave,
    lambda: DcpSave("FileSystemWriter"),
    lambda: DcpPinned("thread"),
    lambda: DcpPinned("process"),
    GdsSave,
    lambda: DcpSave("GdsckptWriter"),
    lambda: GdsSaveAsync("gdsckpt.save_async", {}),
    lambda: GdsSaveAsync("gdsckpt.save_async snapshot=host", {"snapshot": "host"}),
    lambda: GdsSaveAsync("gdsckpt.save_async snapshot=device", {"snapshot": "device"}),
    lambda: GdsSaveAsync("gdsckpt.save_async overlap", {"overlap": True}, optimizer=True),
    DcpGdsckpt,
    lambda: DcpGdsckpt(overlap=True),
    GdsSaveAsyncShards,
    lambda: GdsSaveAsyncShards(overlap=True),
]
ALIASES = {"none": "none", "torch": "torch.save", "dcp-sync": "dcp.save FileSystemWriter",
           "dcp-gdsckpt-sync": "dcp.save GdsckptWriter", "dcp-thread": "dcp.async_save pinned thread",
           "dcp-process": "dcp.async_save pinned process", "save": "gdsckpt.save",
           "async": "gdsckpt.save_async", "async-host": "gdsckpt.save_async snapshot=host",
           "async-device": "gdsckpt.save_async snapshot=device", "async-overlap": "gdsckpt.save_async overlap",
           "async-shards": "gdsckpt.save_async per rank, no DCP",
           "async-shards-overlap": "gdsckpt.save_async overlap per rank, no DCP",
           "dcp-gdsckpt": "dcp.async_save GdsckptWriter", "dcp-gdsckpt-overlap": "dcp.async_save GdsckptWriter overlap"}


def all_methods() -> dict[str, Method]:
    ms = [f() for f in METHODS]
    return {m.name: m for m in ms}


def select(spec: str | None) -> list[Method]:
    table = all_methods()
    if not spec or spec == "all":
        return list(table.values())
    out = []
    for s in spec.split(","):
        name = ALIASES.get(s.strip(), s.strip())
        if name not in table:
            raise SystemExit(f"--methods: unknown {s!r}; known: {', '.join(ALIASES)} (or the full names)")
        out.append(table[name])
    if out[0].name != "none":  # overhead is measured against it
        out = [table["none"]] + [m for m in out if m.name != "none"]
    return out


# ---------------------------------------------------------------- the loop


def build(size: str, device: str):
    from .workload import GPT, token_windows
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


def train_step(model, opt, batches, device, method: Method, hook_t: list):
    from .workload import _Bf16Matmuls
    idx = batches.next()
    cuda = device.startswith("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else _Bf16Matmuls():
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t = time.perf_counter()
    method.before_step()
    waited = time.perf_counter() - t
    hook_t[1] = 0.0
    opt.step()
    t = time.perf_counter()
    value = loss.item()  # the loop logs its loss every step, as many do; here the host waits for the GPU
    return value, waited + hook_t[1], time.perf_counter() - t


def n_checkpoints(steps: int, interval: int) -> int:
    """Checkpoints at steps interval, 2 x interval, ... with a full interval of training after
    each (a loop of 120 steps at interval 40 checkpoints at 40 and 80): the last one gets as
    long to finish in the background as the others, as in a long run; whatever it still needs
    after that is drained inside the timed loop (drain_s)."""
    return max(0, steps // interval - 1 if steps % interval == 0 else steps // interval)


def checkpoint_state(model, opt) -> dict:
    """model + optimizer state; the optimizer's per-parameter keys as strings, so that every
    method (DCP's flattening included) takes the same dict."""
    osd = opt.state_dict()
    return {"model": model.state_dict(),
            "optim": {"state": {str(k): v for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}}


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
    completion: list = field(default_factory=list)
    peak_torch: int = 0
    peak_device: int = 0
    pinned: int = 0
    rss_extra: int = 0
    drain: float = 0.0
    steps: list = field(default_factory=list)  # each training step's seconds (the saves apart)
    ckpt_steps: list = field(default_factory=list)  # the steps a checkpoint followed
    gpu_waits: list = field(default_factory=list)  # of each step, the seconds loss.item() waited for the GPU


def run_loop(ctx: Ctx, method: Method, batches, steps: int, interval: int, tag: str) -> Loop:
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
    # A step pre-hook that save_async(..., optimizer=opt) installs makes opt.step() wait: ours,
    # registered first, stamps the time (hook_t[0]); a second one, registered after each save
    # (so after the library's), adds the time since then to the step's wait (hook_t[1]).
    hook_t = [0.0, 0.0]
    hooks = getattr(method, "with_opt", False)  # only then can the library's hook make a step wait
    waits = hooks or type(method).before_step is not Method.before_step
    first = ctx.opt.register_step_pre_hook(lambda *a: hook_t.__setitem__(0, time.perf_counter())) if hooks else None
    last = None

    def after(*a):
        hook_t[1] += time.perf_counter() - hook_t[0]
    blocked, done_at, started = [], {}, []
    pending = []
    t0 = time.perf_counter()
    step_s, ckpt_steps, gpu_waits = [], [], []
    for step in range(1, steps + 1):
        ts = time.perf_counter()
        _, waited, gpu_wait = train_step(ctx.model, ctx.opt, batches, ctx.device, method, hook_t)
        step_s.append(time.perf_counter() - ts)
        gpu_waits.append(gpu_wait)
        if blocked and waits:
            blocked[-1] += waited  # the wait the last checkpoint imposed on this optimizer step
        if cuda:
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
        if method.name != "none" and step % interval == 0 and step <= steps - interval:
            path = ctx.directory / f"{tag}-step{step}"
            tc = time.perf_counter()
            handle = method.save(ctx, ctx.state(), path)
            te = time.perf_counter()
            blocked.append(te - tc)
            started.append(tc)
            ckpt_steps.append(step)
            i = len(started) - 1
            if handle is None:
                done_at[i] = te
            else:
                handle.add_done_callback(lambda f, i=i: done_at.__setitem__(i, time.perf_counter()))
                pending.append(handle)
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
    if first is not None:
        first.remove()
    if last is not None:
        last.remove()
    loop = Loop(seconds, blocked, [done_at[i] - started[i] for i in range(len(started)) if i in done_at], drain=drain,
                steps=step_s, ckpt_steps=ckpt_steps, gpu_waits=gpu_waits)
    if cuda:
        loop.peak_torch = torch.cuda.max_memory_allocated() - base_alloc
        loop.peak_device = free0 - min_free
        loop.pinned = _pinned_torch()
    loop.rss_extra = max(0, _rss_peak() - rss0)
    return loop


def _summ(xs: list) -> dict:
    if not xs:
        return {"mean": None, "min": None, "max": None, "each": []}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "each": [round(x, 4) for x in xs]}


def _clear(directory: Path) -> None:
    for p in directory.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    os.sync()


def run_train(args) -> dict:
    from .cli import versions
    from .workload import nbytes
    from gdsckpt.backend import gpu_status

    gpu_ok, why = gpu_status()
    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: no CUDA ({why})")
    rk, device = ranks.from_env(args.device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size if args.size in TRAIN_SIZES else ("gpt2-medium" if device.startswith("cuda") else "small-cpu")
    steps, interval, repeats = args.steps, args.interval, args.repeats
    if n_checkpoints(steps, interval) < 1:
        raise SystemExit("--steps must be at least twice --interval (every checkpoint is followed by a full interval)")
    methods = select(args.methods)
    model, opt, windows, minfo = build(size, device)
    if rk:
        opt = ranks.shard(model)
        # every rank its own batches, as data parallel training reads them
        windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(rk.rank))]
    batches = Batches(windows, minfo["batch"], device)
    if rk:
        where, made = rk.shared_directory(args.directory)
        directory, tmp = Path(where), (where if made else None)
    else:
        tmp = None
        directory = Path(args.directory) if args.directory else Path(tmp := tempfile.mkdtemp(prefix="gdsckpt-train-"))
    directory.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(model, opt, directory, device, ranks=rk, dcp_planner=args.dcp_planner)
    hook = [0.0, 0.0]
    for _ in range(3):  # warm-up steps: AdamW creates its state on the first step, kernels compile
        train_step(model, opt, batches, device, NoCheckpoint(), hook)
    state = ctx.state()
    state_bytes = nbytes(state)  # DTensors count their global size
    rank_bytes = ranks.local_bytes(state) if rk else state_bytes
    n_tensors = sum(1 for v in state["model"].values()) + sum(len(s) for s in state["optim"]["state"].values())
    del state
    rows = {m.name: {"name": m.name, "status": "ok", "error": None, "loops": [], "first_save": None,
                     "notes": ""} for m in methods}

    def clear():
        if rk:  # every rank done with the files before rank 0 removes them
            rk.barrier()
        if not rk or rk.rank == 0:
            _clear(directory)
        if rk:
            rk.barrier()

    active = []
    for m in methods:
        why_not = m.available()
        if rk and not m.sharded:
            why_not = "one process's method: under torchrun each rank saves its shards through DCP"
        if why_not:
            rows[m.name].update(status="unavailable", error=why_not)
            continue
        active.append(m)
    try:
        for m in active:  # setup + first save, apart from the loops
            if m.name == "none":
                continue
            print(f"[train] first save: {m.name}", file=sys.stderr, flush=True)
            try:
                m.setup(ctx)
                tc = time.perf_counter()
                h = m.save(ctx, ctx.state(), directory / f"first-{len(rows[m.name]['loops'])}")
                tb = time.perf_counter() - tc
                if h is not None:
                    h.result()
                m.before_step()
                rows[m.name]["first_save"] = {"blocked_s": tb, "completion_s": time.perf_counter() - tc}
            except Exception as e:
                rows[m.name].update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
            clear()
        for r in range(repeats):
            for m in active:
                if rows[m.name]["status"] != "ok":
                    continue
                print(f"[train] repeat {r + 1}/{repeats}: {m.name}", file=sys.stderr, flush=True)
                ctx.io_path = ctx.stored_bytes = None
                ctx.pinned = 0
                try:
                    loop = run_loop(ctx, m, batches, steps, interval, f"r{r}")
                    rows[m.name]["loops"].append(loop)
                    if ctx.stored_bytes:
                        rows[m.name]["stored_bytes"] = ctx.stored_bytes
                    if ctx.io_path:
                        rows[m.name]["io_path"] = ctx.io_path
                    rows[m.name]["_pinned"] = max(rows[m.name].get("_pinned") or 0, ctx.pinned) or None
                except Exception as e:
                    rows[m.name].update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
                clear()
    finally:
        for m in active:
            try:
                m.teardown()
            except Exception:
                pass
        if rk:
            rk.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    ckpts = n_checkpoints(steps, interval)
    none_loops: list[Loop] = rows["none"]["loops"]
    base_torch = max((l.peak_torch for l in none_loops), default=0)
    base_device = max((l.peak_device for l in none_loops), default=0)
    out_methods = []
    for m in methods:
        row = rows[m.name]
        row["notes"] = row["notes"] or m.notes
        loops: list[Loop] = row.pop("loops")
        if loops and none_loops:
            # Paired with the 'none' loop of the same repeat (they ran minutes apart at most).
            over = [(l.seconds - none_loops[min(i, len(none_loops) - 1)].seconds) / ckpts for i, l in enumerate(loops)]
            row.update({
                "loops_s": [round(l.seconds, 4) for l in loops],
                "drain_s": [round(l.drain, 4) for l in loops],
                "overhead_per_ckpt_s": _summ(over if m.name != "none" else []),
                "blocked_s": _summ([b for l in loops for b in l.blocked]),
                "completion_s": _summ([c for l in loops for c in l.completion]),
                "steps_after_ckpt_extra_s": _extra_after_ckpt(loops, none_loops, interval) if m.name != "none" else None,
                "gpu_wait_after_ckpt_extra_s": (_extra_after_ckpt(loops, none_loops, interval, "gpu_waits")
                                                if m.name != "none" else None),
                "overhead_in_loop_per_ckpt_s": _summ([_in_loop_overhead(l, interval, ckpts) for l in loops]
                                                     if m.name != "none" else []),
                "gpu": {"peak_extra_torch_bytes": max(l.peak_torch for l in loops) - base_torch,
                        "peak_extra_device_bytes": max(l.peak_device for l in loops) - base_device},
                "host": {"pinned_torch_bytes": max(l.pinned for l in loops),
                         "pinned_gdsckpt_bytes": row.pop("_pinned", None),
                         "rss_peak_extra_bytes": max(l.rss_extra for l in loops)},
            })
        out_methods.append(row)
    none_mean = statistics.fmean(l.seconds for l in none_loops) if none_loops else None
    result = {"schema": TRAIN_SCHEMA, "mode": "train",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "device": {"kind": "gpu" if device.startswith("cuda") else "cpu",
                       "name": torch.cuda.get_device_name() if device.startswith("cuda")
                       else (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cores)"},
            "versions": versions(), "gpu_backend": gpu_ok,
            "io_path": next((r.get("io_path") for r in out_methods if r.get("io_path")), None),
            "model": minfo, "state": {"logical_bytes": state_bytes, "tensors": n_tensors},
            "steps": steps, "interval": interval, "checkpoints_per_loop": ckpts, "repeats": repeats,
            "dcp_planner": args.dcp_planner,
            "step_s": none_mean / steps if none_mean else None,
            "methods": out_methods, "cost": None}
    if rk:
        result["model"]["sharding"] = f"FSDP2 over {rk.world} ranks"
        result["state"]["per_rank_bytes"] = rank_bytes
        result["world_size"] = rk.world
        per_rank = rk.gather([_rank_row(r) for r in out_methods])
        result["ranks"] = [{"rank": i, "methods": rows_i} for i, rows_i in enumerate(per_rank)]
        result["rank"] = rk.rank
        rk.close()
    result["targets"] = targets.check(result)
    return result


def _in_loop_overhead(loop: Loop, interval: int, ckpts: int) -> float:
    """Overhead per checkpoint against the loop's own first interval, before any checkpoint
    (its median step, the loop's first step left out): loop seconds - steps x that median.
    Immune to drift between loops (on the 2x H200 host, 'none' loops ran up to 12% slower
    or faster than the loops beside them), blind to a slowdown that outlasts the interval."""
    base = statistics.median(loop.steps[1:interval] or loop.steps[:interval])
    return (loop.seconds - len(loop.steps) * base) / ckpts


def _extra_after_ckpt(loops: list, none_loops: list, interval: int, what: str = "steps") -> list | None:
    """Where a method's loop time lands: for k = 1..interval, how much longer the k-th training
    step after a checkpoint took than the median step of the same repeat's 'none' loop (mean
    over checkpoints and repeats). A step's time includes any wait the method imposes before
    opt.step (blocked time, also counted there); the checkpoint call itself is not in it.
    what="gpu_waits": the same for the part of each step the host waited for the GPU (more:
    the GPU ran slower; less, with a slower step: the host did)."""
    extra = [[] for _ in range(interval)]
    for i, loop in enumerate(loops):
        base = statistics.median(getattr(none_loops[min(i, len(none_loops) - 1)], what))
        per_step = getattr(loop, what)
        for c in loop.ckpt_steps:
            for k in range(interval):
                if c + k < len(per_step):
                    extra[k].append(per_step[c + k] - base)
    return [round(statistics.fmean(e), 4) for e in extra] if extra and extra[0] else None


def _rank_row(r: dict) -> dict:
    """The figures of one rank's method row that the per-rank table shows."""
    keep = ("name", "status", "error", "overhead_per_ckpt_s", "blocked_s", "completion_s", "first_save",
            "steps_after_ckpt_extra_s", "gpu_wait_after_ckpt_extra_s", "overhead_in_loop_per_ckpt_s", "gpu", "host",
            "stored_bytes")
    return {k: r[k] for k in keep if k in r}




# ---------------------------------------------------------------- output


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


def print_train(result: dict, out=None) -> None:
    out = out or sys.stdout
    d = result
    m = d["model"]
    print(f"gdsckpt-bench --train {d['date']}  device: {d['device']['name']}  io: {d['io_path']}", file=out)
    print(f"  model: GPT {m['layers']}x{m['d_model']} ({m['params'] / 1e6:.1f}M params), batch {m['batch']}x{m['seq']}; "
          f"state {d['state']['logical_bytes'] / 1e9:.2f} GB ({d['state']['tensors']} tensors); "
          f"step {_f(d['step_s'] and d['step_s'] * 1e3, '{:.1f}')} ms; a checkpoint every {d['interval']} steps, "
          f"{d['checkpoints_per_loop']} per loop of {d['steps']} steps, {d['repeats']} repeat(s)", file=out)
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
        if r.get("steps_after_ckpt_extra_s"):
            print(f"  {r['name']:<44} overhead/ckpt against its own first interval "
                  f"{_f(r['overhead_in_loop_per_ckpt_s']['mean'])} s; steps after a checkpoint took "
                  f"{_after(r)}", file=out)
    for rr in d.get("ranks", []):
        for r in rr["methods"]:
            if r.get("overhead_per_ckpt_s") and r["name"] != "none":
                o, b = r["overhead_per_ckpt_s"], r["blocked_s"]
                print(f"  rank {rr['rank']} {r['name']:<36}{_f(o['mean']):>8} s overhead, {_f(b['mean'])} s blocked "
                      f"(max {_f(b['max'])}), done {_f(r['completion_s']['mean'], '{:.2f}')} s, "
                      f"+GPU {r['gpu']['peak_extra_torch_bytes'] / 2**30:.2f} GiB"
                      + (f"; in-loop overhead {_f(r['overhead_in_loop_per_ckpt_s']['mean'])} s, steps after "
                         f"{_after(r)}" if r.get("steps_after_ckpt_extra_s") else ""),
                      file=out)
    print("  overhead/ckpt: (loop s - the same repeat's 'none' loop s) / checkpoints per loop, mean (min..max);"
          " blocked: the caller's wait per checkpoint; done: call to durable; first: the first save's blocked s,"
          " outside the loops; +GPU: torch peak over the 'none' loop; +dev: device-wide (cudaMemGetInfo, per step);"
          " pinned: torch's pinned host allocator", file=out)
    targets.print_targets(d.get("targets") or [], out)
    if d.get("cost"):
        from .cost import print_cost
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


def add_arguments(ap) -> None:
    """The --train and --cost options (gdsckpt-bench's own parser; --size, --device,
    --directory, --output, --output-format and --plot are shared)."""
    from . import cost
    g = ap.add_argument_group("--train: checkpoints inside a training loop")
    g.add_argument("--train", action="store_true", help="measure checkpoints inside a real training loop")
    g.add_argument("--steps", type=int, default=120,
                   help="training steps per loop (--train); checkpoints every --interval steps but in the last interval")
    g.add_argument("--interval", type=int, default=40, help="a checkpoint every N steps (--train)")
    g.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every method's loop (--train)")
    g.add_argument("--dcp-planner", choices=["cached", "default"], default="cached",
                   help="the save planner of every DCP method (--train): gdsckpt.dcp.CachedSavePlanner, "
                        "DCP's plan caching, as torchtitan-scale runs use it; or DCP's DefaultSavePlanner")
    g.add_argument("--methods", default=None,
                   help="comma list (--train): " + ", ".join(ALIASES) + " (default: all that run here)")
    cost.add_arguments(ap)


def main(args) -> int:
    from . import cost
    if args.train:
        result = run_train(args)
        if result.get("rank", 0) != 0:  # under torchrun rank 0 reports every rank
            return 0
    else:
        if not args.cost_from:
            raise SystemExit("--cost needs --train (this run) or --cost-from RESULT.json")
        result = json.loads(Path(args.cost_from).read_text())
    if args.cost:
        result["cost"] = cost.compute(result, args)
    if args.output and args.train:
        Path(args.output).write_text(json.dumps(result, indent=1))
    elif args.output:
        Path(args.output).write_text(json.dumps(result["cost"], indent=1))
    if args.output_format == "json":
        json.dump(result if args.train else result["cost"], sys.stdout, indent=1)
        print()
    elif args.train:
        print_train(result)
    else:
        cost.print_cost(result["cost"])
    if args.plot and args.train:
        plot_train(result, args.plot)
    return 0
