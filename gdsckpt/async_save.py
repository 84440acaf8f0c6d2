"""save_async: a checkpoint that does not stop training.

    fut = gdsckpt.save_async(state, "ckpt.gdsckpt")   # returns once `state` is safe to mutate
    optimizer.step()                                   # training goes on while the file is written
    stats = fut.result()                               # durable once this returns

Three ways to take the snapshot (`snapshot=`, `overlap=`):

* snapshot="host" (default): the save ring runs on the live tensors in the calling thread
  (gather, compress, checksum: the GPU part of a save) and copies each compressed chunk into a
  host pool (pinned memory on the GPU, device-to-host on a dedicated copy stream). save_async
  returns once every chunk is in the pool: the caller waits about state size / compression and
  copy throughput, not for the disk. A background thread then only writes the pool's bytes to
  a temporary file (O_DIRECT where the file system allows it), fsyncs it and renames it over
  `path` exactly as `save` does. Extra GPU memory: the ring (about 835 MiB at the defaults),
  never a copy of the state. Host memory: the pool (gdsckpt/pinned_pool.py), allocated by the
  first saves and reused, holding stored (compressed) bytes; bounded by `pool_bytes` (default:
  the most the save can store: its logical size, chunk by chunk rounded up to 4 KiB; at most
  half the host's memory; defaults.POOL_*). A save that finds the pool full waits for the
  writer to free room (back-pressure): that wait is part of the call, reported as
  `pool_wait_s` / `pool_waits` in the stats.

* overlap=True, optimizer=opt: the same snapshot, but on a background thread, so that it runs
  during the next forward and backward; save_async returns at once. It relies on this contract:

  - parameters of `opt` and tensors in `opt.state` (the AdamW moments and step counts) may be
    changed only by `opt.step()` until the snapshot is complete. save_async installs a step
    pre-hook on `opt` that makes the next `opt.step()` wait for the snapshot (the wait is
    `hook_wait_s` in the stats), and removes it afterwards. Forward and backward may run
    (they read parameters and write gradients, which are not part of the state); what must
    not happen before that step is anything else writing those tensors in place: an EMA
    update, `load_state_dict`, a manual `p.data.copy_`, `clip_grad` on parameters, a second
    optimizer that shares them, or `opt.zero_grad()` is fine (gradients are not saved).
  - every other tensor of `state` (buffers such as BatchNorm running statistics, anything not
    a parameter of `opt` and not in `opt.state`) is copied before save_async returns (on its
    own device; device-to-device on a side stream), so forward may update it at once.
  - plain values (ints, floats, strings: the step, the learning rate) are captured at the call.
  Without `optimizer=`, overlap=True is a ValueError: nothing would stop the step.

* snapshot="device": the previous behaviour, for hosts with spare GPU memory: every tensor
  is copied on its own device (a full copy of the state, held until the write ends), then
  `gdsckpt.save` runs on a background thread. Never concurrent with another save_async.

One save in flight, and what that means:
* save_async calls are serialized: a call waits for the previous call's snapshot (in overlap
  mode, the previous background snapshot) before it takes its own.
* files are written one at a time, in call order, and committed in call order (never
  interleaved), by one writer thread. A host snapshot may be taken while earlier files are
  still being written, if the pool has room for it (else it waits, see back-pressure).
  snapshot="device" first waits for every earlier save_async to finish, as before, and a
  host snapshot waits for an earlier device-mode save to finish.
* wait=False: raise SaveInFlightError instead of starting while any earlier save_async has not
  finished (snapshot or write).
* failures: a save that fails in the background (a full disk, an I/O error, a missing
  directory) leaves `path` as it was (the old checkpoint, if any, stays intact; the temporary
  is removed) and raises on `fut.result()`. If nobody looked at that future (result() or
  exception()), the next save_async raises BackgroundSaveError naming the path, and does not
  start; the call after that goes ahead.

The returned future's result is an AsyncStats (a Stats with `blocked_s`, `snapshot_s`,
`background_s`, `queued_s`, the pool's figures and `hook_wait_s`); `seconds` runs from the
call to the commit. Stats of an overlap save are updated with `hook_wait_s` when the step waits.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections import defaultdict
from concurrent.futures import Future
from concurrent.futures import wait as _wait_for
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from . import api
from .defaults import POOL_HOST_FRACTION, POOL_STATE_FRACTION
from .errors import BackgroundSaveError, SaveInFlightError
from .host_snapshot import PoolDestination, side_stream
from .pinned_pool import align_up, pools, release_pools
from .storage import save_target, user_path
from .tree import flatten, unflatten

__all__ = ["save_async", "AsyncStats", "SaveFuture", "SaveInFlightError", "BackgroundSaveError",
           "snapshot_tensors", "release_pools", "pools", "default_pool_limit"]

MODES = ("host", "device")


def __getattr__(name: str):
    # The DTensor-aware snapshot moved to dcp.py, its one user; the old import path still works.
    if name == "snapshot_state_dict":
        from .dcp import snapshot_state_dict
        return snapshot_state_dict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class AsyncStats(api.Stats):
    """A save_async's Stats. The caller's stall is `blocked_s` (+ `hook_wait_s` in overlap mode)."""

    mode: str = "host"  # "host", "overlap" or "device"
    blocked_s: float = 0.0  # inside save_async: the snapshot (host), the copies (device), the buffer copies (overlap)
    hook_wait_s: float = 0.0  # overlap: how long optimizer.step() waited for the snapshot
    snapshot_s: float = 0.0  # the ring and the copies into the pool (host, overlap)
    queued_s: float = 0.0  # the file's write waited this long for earlier files
    background_s: float = 0.0  # the writer on this file, its turn to the commit (device: the whole save)
    write_s: float = 0.0  # of which in pwritev of chunk records
    fsync_s: float = 0.0
    commit_s: float = 0.0
    direct_io: bool = False
    pool_bytes: int = 0  # host memory the pool holds (pinned on the GPU), after this snapshot
    pool_peak_bytes: int = 0  # of which in use at most during this snapshot
    pool_limit_bytes: int = 0
    pool_waits: int = 0  # chunk copies that waited for the writer to free room (back-pressure)
    pool_wait_s: float = 0.0
    pool_alloc_s: float = 0.0  # growing the pool (the first saves)


class SaveFuture(Future):
    """A concurrent.futures.Future that remembers whether its outcome was looked at (result()
    or exception()): an unseen failure is raised by the next save_async."""

    observed = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            if self.done():
                self.observed = True

    def exception(self, timeout=None):
        try:
            return super().exception(timeout)
        finally:
            if self.done():
                self.observed = True


_calls = threading.Lock()  # one save_async call at a time
_tracked: list[tuple[SaveFuture, str, str]] = []  # (future, mode, path) of calls not known finished
_snapshot_done = threading.Event()  # the last overlap snapshot has ended
_snapshot_done.set()
_hooks: list = []  # [handle, done event] of step pre-hooks not yet removed


def default_pool_limit(plan) -> int:
    """The pool's bound for a save of `plan`: defaults.POOL_STATE_FRACTION of the most it can
    store (each chunk's logical length rounded up to 4 KiB, as the pool holds records; a chunk
    that would not shrink is stored raw), at most defaults.POOL_HOST_FRACTION of the host's memory."""
    limit = int(sum(align_up(c.length) for c in plan.chunks) * POOL_STATE_FRACTION)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = min(limit, int(host * POOL_HOST_FRACTION))
    except (ValueError, OSError, AttributeError):
        pass
    return max(limit, 1)


def save_async(state, path, *, snapshot: str = "host", overlap: bool = False, optimizer=None,
               pool_bytes: int | None = None, wait: bool = True, **save_kwargs) -> SaveFuture:
    """Save `state` to `path` without stopping training; returns a SaveFuture of AsyncStats,
    complete once the file is durable (fsync'd and renamed over `path`). The module docstring
    says when `state` may be mutated in each mode, what it costs, and the in-flight rules.

    snapshot: "host" (default: compressed into a host pool) or "device" (a same-device copy).
    overlap: with optimizer=opt, take the host snapshot during the next forward/backward; the
    next opt.step() waits for it. pool_bytes: the host pool's bound for this save (None: the
    state's logical size, chunk by chunk rounded up to 4 KiB). wait=False: SaveInFlightError if an earlier save_async is unfinished.
    save_kwargs: codec, chunk_bytes, ring_depth, io, io_threads, backend, as for gdsckpt.save.
    Raised here: an unsupported state (before anything is copied), bad options, an earlier
    unseen background failure (BackgroundSaveError), and errors of the snapshot itself.
    """
    if snapshot not in MODES:
        raise ValueError(f"snapshot must be one of {', '.join(map(repr, MODES))}, not {snapshot!r}")
    if overlap and optimizer is None:
        raise ValueError("overlap=True needs optimizer=: the snapshot runs during the next forward/backward, and "
                         "only a step pre-hook on the optimizer keeps the step from changing the state under it")
    if overlap and snapshot != "host":
        raise ValueError("overlap=True takes the host snapshot; snapshot='device' copies the state before returning")
    if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
        raise ValueError(f"optimizer= must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if pool_bytes is not None and (not isinstance(pool_bytes, int) or isinstance(pool_bytes, bool) or pool_bytes < 1):
        raise ValueError(f"pool_bytes must be a positive int or None, not {pool_bytes!r}")
    t0 = time.perf_counter()
    target = save_target(user_path(path, "save_async"))  # a bad path is refused here, before any copy
    skeleton, leaves = flatten(state)  # validates the whole state before anything is copied
    if not _calls.acquire(blocking=wait):
        raise SaveInFlightError(f"a save_async is still in flight; not saving {str(path)!r} "
                                "(call .result() on its future first, or pass wait=True)")
    try:
        wait_for_snapshot()
        _surface_failures(path)
        if not wait and any(not f.done() for f, _, _ in _tracked):
            raise SaveInFlightError(f"a save_async is still in flight; not saving {str(path)!r} "
                                    "(call .result() on its future first, or pass wait=True)")
        if snapshot == "device":
            _wait_for([f for f, _, _ in _tracked])
            fut = _device_save(skeleton, leaves, path, save_kwargs, t0)
            mode = "device"
        else:
            _wait_for([f for f, m, _ in _tracked if m == "device"])
            dest = PoolDestination(target, pool_bytes or default_pool_limit, save_kwargs.get("chunk_bytes"))
            if overlap:
                fut = _overlap_save(skeleton, leaves, dest, optimizer, save_kwargs, t0)
                mode = "overlap"
            else:
                fut = _host_save(state, leaves, dest, save_kwargs, t0)
                mode = "host"
        _tracked.append((fut, mode, str(path)))
        return fut
    finally:
        _calls.release()


# ---------------------------------------------------------------- host snapshot (default, overlap)


def _host_save(state, leaves, dest: PoolDestination, save_kwargs: dict, t0: float) -> SaveFuture:
    fut = _new_future()
    with _on_device(_cuda_device_of(l.tensor for l in leaves)):
        snap = api._save(state, dest, **save_kwargs)  # on error: raised here, the job aborted, the temporary removed
    _link(fut, dest, snap, "host", t0, time.perf_counter() - t0)
    return fut


def _overlap_save(skeleton, leaves, dest: PoolDestination, optimizer, save_kwargs: dict, t0: float) -> SaveFuture:
    tensors = freeze_for_overlap([l.tensor for l in leaves], optimizer)
    state = unflatten(skeleton, tensors)
    fut = _new_future()
    hook = HookTimer()
    blocked = time.perf_counter() - t0

    def finish(snap, error):
        if error is not None:
            fut.set_exception(error)
        else:
            _link(fut, dest, snap, "overlap", t0, blocked, hook)

    run_overlapped(lambda: api._save(state, dest, **save_kwargs), _cuda_device_of(tensors), optimizer, finish, hook)
    return fut


def freeze_for_overlap(tensors: list, optimizer) -> list:
    """`tensors` as a snapshot taken during the next forward/backward may read them: those that
    only `optimizer`'s step changes as they are, every other one (buffers) copied now."""
    guarded = optimizer_memory(optimizer)
    tensors = list(tensors)
    loose = [i for i, t in enumerate(tensors) if memory_of(t) not in guarded]
    for i, copy in zip(loose, snapshot_tensors([tensors[i] for i in loose])):
        tensors[i] = copy
    return tensors


def wait_for_snapshot() -> None:
    """Wait for a running overlap snapshot (it owns the ring and the pool); drop the step hooks
    of finished ones."""
    _snapshot_done.wait()
    _remove_hooks()


def run_overlapped(snapshot: Callable[[], Any], gpu: int | None, optimizer, finish: Callable[[Any, BaseException | None], None],
                   hook: HookTimer | None = None) -> None:
    """Run snapshot() on a background thread, on the GPU's "snapshot" side stream started after
    the work queued so far (not after later work), and make `optimizer`'s next step wait for it
    (the wait goes to `hook`). finish(result, None) or finish(None, error) runs on that thread
    before the step may go on."""
    fence = None
    if gpu is not None:
        fence = side_stream("snapshot", torch.device("cuda", gpu))
        fence.wait_stream(torch.cuda.current_stream(gpu))
    done = threading.Event()
    hook = hook or HookTimer()
    _snapshot_done.clear()

    def run():
        try:
            with _on_device(gpu), (torch.cuda.stream(fence) if fence is not None else contextlib.nullcontext()):
                result = snapshot()
        except BaseException as e:  # noqa: BLE001 - the future carries it; the next save raises it if unseen
            traceback.clear_frames(e.__traceback__)
            finish(None, e)
        else:
            finish(result, None)
        finally:
            done.set()
            _snapshot_done.set()

    try:
        threading.Thread(target=run, name="gdsckpt-snapshot", daemon=False).start()
    except BaseException:
        _snapshot_done.set()
        raise
    _install_hook(optimizer, done, hook)


class HookTimer:
    """The step pre-hook's wait, added to the save's stats whenever they exist."""

    def __init__(self):
        self.waited = 0.0
        self.stats: AsyncStats | None = None
        self.lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self.lock:
            self.waited += seconds
            if self.stats is not None:
                self.stats.hook_wait_s = self.waited


def _install_hook(optimizer, done: threading.Event, timer: HookTimer) -> None:
    """A step pre-hook that waits for the snapshot, then goes away. It cannot remove itself while
    the optimizer iterates its hooks (an OrderedDict) unless it is the last one; otherwise a
    step post-hook removes it, and is itself removed by the next save_async."""
    entry: list = []

    def pre_hook(opt, args, kwargs):
        if not done.is_set():
            t = time.perf_counter()
            done.wait()
            timer.add(time.perf_counter() - t)
        handle = entry[0]
        hooks = opt._optimizer_step_pre_hooks
        if handle.id in hooks and next(reversed(hooks)) == handle.id:
            handle.remove()
        elif handle.id in hooks and len(entry) == 1:
            def post_hook(opt, args, kwargs):
                handle.remove()
            entry.append(opt.register_step_post_hook(post_hook))
            _hooks.append([entry[1], done])
        return None

    entry.append(optimizer.register_step_pre_hook(pre_hook))
    _hooks.append([entry[0], done])


def _remove_hooks() -> None:
    """Remove the hooks of earlier overlap saves whose snapshot has ended (called outside any
    step, in save_async): a pre-hook whose step never came, a post-hook left to do nothing."""
    for entry in list(_hooks):
        handle, done = entry
        if done.is_set():
            handle.remove()
            _hooks.remove(entry)


def optimizer_memory(optimizer) -> set:
    """The memory of every parameter of `optimizer` and every tensor in its state: what only
    its step changes."""
    out = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.add(memory_of(p))
    for st in optimizer.state.values():
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out.add(memory_of(v))
    out.discard(None)
    return out


def memory_of(t: torch.Tensor):
    """The tensor's storage (device, base address): a state_dict() entry shares it with its
    parameter; a DTensor (FSDP2's parameters and optimizer state) by its local shard's."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr())


def _link(fut: SaveFuture, dest: PoolDestination, snap: api.Stats, mode: str, t0: float, blocked: float,
          hook: HookTimer | None = None) -> None:
    """Complete `fut` when the writer has committed the file (or failed)."""
    file = dest.file

    def done(job_future):
        err = job_future.exception()
        if err is not None:
            fut.set_exception(err)
            return
        try:
            stats = _stats(job_future.result())
        except BaseException as e:  # noqa: BLE001 - a future left pending would hang result() forever
            fut.set_exception(e)
        else:
            fut.set_result(stats)

    def _stats(report) -> AsyncStats:
        base = {f.name: getattr(snap, f.name) for f in fields(api.Stats)}
        base.update(path=dest.label, io_path="pool-direct" if report.direct_io else "pool-buffered",
                    file_bytes=dest.layout.file_bytes, seconds=time.perf_counter() - t0,
                    memory=dict(snap.memory, pinned_host_bytes=dest.pool.capacity if dest.pool.pinned else 0,
                                pool_host_bytes=dest.pool.capacity))
        stats = AsyncStats(**base, mode=mode, blocked_s=blocked, snapshot_s=snap.seconds,
                           queued_s=report.queued_s, background_s=report.background_s, write_s=report.write_s,
                           fsync_s=report.fsync_s, commit_s=report.commit_s, direct_io=report.direct_io,
                           pool_bytes=dest.pool.capacity, pool_peak_bytes=file.peak, pool_limit_bytes=dest.limit,
                           pool_waits=file.waits, pool_wait_s=file.wait_s, pool_alloc_s=file.alloc_s)
        if hook is not None:
            with hook.lock:
                stats.hook_wait_s = hook.waited
                hook.stats = stats
        return stats

    dest.job.done.add_done_callback(done)


# ---------------------------------------------------------------- device snapshot (snapshot="device")


def snapshot_tensors(tensors: list) -> list:
    """Contiguous private copies of `tensors`, each on the tensor's own device; complete on return.

    CUDA tensors are copied on a per-GPU side stream that waits for the GPU's current stream;
    the side streams are synchronized before returning."""
    out: list = [None] * len(tensors)
    by_gpu: dict[torch.device, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.is_cuda:
            by_gpu[t.device].append(i)
        else:
            out[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    used = []
    for dev, idx in by_gpu.items():
        side = side_stream("snapshot", dev)
        with torch.cuda.device(dev):
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i in idx:
                    src = tensors[i].detach()
                    out[i] = torch.empty(src.shape, dtype=src.dtype, device=dev)
                    out[i].copy_(src, non_blocking=True)
        used.append(side)
    for side in used:
        side.synchronize()
    return out


def _device_save(skeleton, leaves, path, save_kwargs: dict, t0: float) -> SaveFuture:
    copies = snapshot_tensors([l.tensor for l in leaves])
    held = [unflatten(skeleton, copies)]
    gpu = _cuda_device_of(copies)
    del copies
    fut = _new_future()
    blocked = time.perf_counter() - t0

    def run():
        try:
            snap = held.pop()
            try:
                t = time.perf_counter()
                with _on_device(gpu):  # a new thread's current device is 0, not the caller's
                    stats = api.save(snap, path, **save_kwargs)
                background = time.perf_counter() - t
            finally:
                del snap  # the snapshot's memory goes back before the next save_async may start
        except BaseException as e:  # noqa: BLE001
            traceback.clear_frames(e.__traceback__)  # frames of the failed save hold snapshot tensors
            fut.set_exception(e)
        else:
            base = {f.name: getattr(stats, f.name) for f in fields(api.Stats)}
            base["seconds"] = time.perf_counter() - t0
            fut.set_result(AsyncStats(**base, mode="device", blocked_s=blocked, background_s=background))

    threading.Thread(target=run, name="gdsckpt-save-async", daemon=False).start()
    return fut


# ---------------------------------------------------------------- helpers


def _new_future() -> SaveFuture:
    fut = SaveFuture()
    fut.set_running_or_notify_cancel()  # it cannot be cancelled: the snapshot is already taken
    return fut


def _surface_failures(path) -> None:
    """Forget finished saves; raise BackgroundSaveError for failures nobody has looked at."""
    failed = []
    for entry in list(_tracked):
        fut, _, where = entry
        if not fut.done():
            continue
        _tracked.remove(entry)
        err = Future.exception(fut, 0)
        if err is not None and not fut.observed:
            fut.observed = True
            failed.append((where, err))
    if failed:
        where, err = failed[0]
        more = f" (and {len(failed) - 1} more: {', '.join(repr(w) for w, _ in failed[1:])})" if len(failed) > 1 else ""
        raise BackgroundSaveError(f"an earlier save_async of {where!r} failed in the background{more}: "
                                  f"{type(err).__name__}: {err}; {str(path)!r} was not saved (call again to save "
                                  "it; the earlier file was not changed)", path=where) from err


def _cuda_device_of(tensors) -> int | None:
    for t in tensors:
        if t.is_cuda:
            return t.device.index
    return None


def _on_device(index: int | None):
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()
