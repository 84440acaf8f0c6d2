"""save_async: a checkpoint that does not stop training.

    fut = gdsckpt.save_async(state, "ckpt.gdsckpt")   # returns once `state` is safe to mutate
    optimizer.step()                                   # training goes on while the file is written
    stats = fut.result()                               # durable once this returns

Three ways to take the snapshot (`snapshot=`: the modes of save.Snapshot, which GdsckptWriter
takes too; `overlap=True` is the earlier spelling of snapshot="overlap" and still works):

* snapshot="host" (default): the save ring runs on the live tensors in the calling thread
  (gather, compress, checksum: the GPU part of a save) and copies each compressed chunk into a
  host pool (pinned memory on the GPU, device-to-host on a dedicated copy stream). save_async
  returns once every chunk is in the pool: the caller waits about state size / compression and
  copy throughput, not for the disk. A background thread then only writes the pool's bytes to
  a temporary file (O_DIRECT where the file system allows it), fsyncs it and renames it over
  `path` exactly as `save` does. Extra GPU memory: the ring (about 835 MiB at the defaults),
  and a copy of the state only in a save that finds its pool empty (below). Host memory: the
  pool (gdsckpt/engine/pinned_pool.py), allocated by the first saves and reused, holding stored
  (compressed) bytes; bounded by `pool_bytes` (default:
  the most the save can store: its logical size, chunk by chunk rounded up to 4 KiB; at most
  half the host's memory; defaults.POOL_*). A save that finds the pool full waits for the
  writer to free room (back-pressure): that wait is part of the call, reported as
  `pool_wait_s` / `pool_waits` in the stats.

* snapshot="overlap", optimizer=opt (the default where `state` holds its optimizer itself, see
  save_async): the same snapshot, but on a background thread, so that it runs
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
  Without `optimizer=`, snapshot="overlap" is a ValueError: nothing would stop the step.

* a save (host or overlap, no memory=) that finds its GPU's pool empty, nothing reserving it
  (the process's first, or the first after release_pools): the state is copied on the GPU where
  defaults.FIRST_SAVE_COPY_FREE_FRACTION of its free memory holds the copy, save_async returns,
  and the host snapshot is taken from the copy on a background thread, growing the pool there
  (a SaveCall's copy_first, device_copy.copy_first); no optimizer step waits for it. Page-locking a pool
  of ~5 GB in the call blocked a first save 2 s on the H100's VMs; the copy, 0.07-0.13 s beyond
  a steady save.

* snapshot="device", for hosts with spare GPU memory: every save takes the path of a first save
  above, whatever its pool holds and without the free-memory test: the state copied on its GPU,
  the call returns, and the compressed host snapshot is taken from the copy on a background
  thread, which lets the copy go once its chunks are in the pool (~0.1-0.2 s later, not when
  the file is written). No optimizer= is needed, and no step waits. The copies come from
  torch's cache and go back to it, where the training reuses them: a block of CUDA's own
  allocator, given back to the device after every save, cost the training thread ~16 ms a
  save more (mapped again, and unmapped at its next synchronize: bench/probes/copy_block_cost.py).
  Where torch has no room for the copy, the save takes the host snapshot in the call instead
  (logged; its stats say mode "host"). With memory= (the Checkpointer's memory tier) the copy
  is compressed into the tier's shared memory instead of the pool, as the other modes are.

One save in flight, and what that means:
* save_async calls are serialized: a call waits for the previous call's snapshot (in overlap
  mode, the previous background snapshot) before it takes its own.
* files are written one at a time, in call order, and committed in call order (never
  interleaved), by one writer thread. A snapshot may be taken while earlier files are
  still being written, if the pool has room for it (else it waits, see back-pressure).
* wait=False: raise SaveInFlightError instead of starting while any earlier save_async has not
  finished (snapshot or write).
* failures: a failure in the snapshot is raised by the call, and its room in the pool goes back
  whatever it was (KeyboardInterrupt included). A save that fails in the background (a full disk, an I/O error, a missing
  directory) leaves `path` as it was (the old checkpoint, if any, stays intact; the temporary
  is removed) and raises on `fut.result()`. If nobody looked at that future (result() or
  exception()), the next save_async raises BackgroundSaveError naming the path, and does not
  start; the call after that goes ahead.

The returned future's result is an AsyncStats (a Stats with `blocked_s`, `snapshot_s`,
`background_s`, `queued_s`, the pool's figures and `hook_wait_s`); `seconds` runs from the
call to the commit. Stats of an overlap save are updated with `hook_wait_s` when the step waits.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import fields

from gdsckpt.core import collector
from .snapshot import modes as snapshot_modes
from gdsckpt.core.defaults import POOL_HOST_FRACTION, POOL_STATE_FRACTION
from gdsckpt.engine.device_copy import (
    block_bytes, copy_first, cuda_device_of, on_device, outside_cache, snapshot_tensors,
)
from gdsckpt.errors import BackgroundSaveError, SaveInFlightError
from .snapshot.host import PoolDestination, SnapshotDestination, SnapshotTarget
from .snapshot.overlap import HookTimer, fencing_optimizer, freeze, run_overlapped, wait_for_snapshot
from .snapshot.overlap import memory_of, optimizer_memory  # importable from here, as before
from gdsckpt.engine.pinned_pool import align_up, pools, release_pools
from .save import SaveOptions, Snapshot, save_flat
from gdsckpt.stats import AsyncStats, Stats
from gdsckpt.core.storage import save_target, user_path
from gdsckpt.format.tree import Leaf, flatten

__all__ = ["save_async", "AsyncStats", "SaveFuture", "SaveInFlightError", "BackgroundSaveError",
           "release_pools", "pools", "default_pool_limit", "check_pool_bytes", "memory_of",
           "optimizer_memory", "wait_for_saves_to", "inferred_overlap"]


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


def wait_for_saves_to(path) -> None:
    """Wait for every save_async in flight to `path` (compared by real path; whoever called it),
    without looking at their outcome: a reader of `path` then finds the newest committed file."""
    want = os.path.realpath(path)
    for fut, _, where in list(_tracked):
        if os.path.realpath(where) == want:
            Future.exception(fut)  # waits; SaveFuture.exception() would count as its caller's look


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


def check_pool_bytes(pool_bytes) -> None:
    """pool_bytes=: a positive int or None (the default bound), else a ValueError."""
    if pool_bytes is not None and (not isinstance(pool_bytes, int) or isinstance(pool_bytes, bool) or pool_bytes < 1):
        raise ValueError(f"pool_bytes must be a positive int or None, not {pool_bytes!r}")


@collector.paused()  # the call's objects (the skeleton, a Leaf per tensor) meet one young collection
def save_async(state, path, *, snapshot: str | None = None, overlap: bool | None = None, optimizer=None,
               pool_bytes: int | None = None, wait: bool = True, memory: SnapshotTarget | None = None,
               **save_options) -> SaveFuture:
    """Save `state` to `path` without stopping training; returns a SaveFuture of AsyncStats,
    complete once the file is durable (fsync'd and renamed over `path`). The module docstring
    says when `state` may be mutated in each mode, what it costs, and the in-flight rules.

    snapshot: "host" (default: compressed into a host pool), "overlap" (with optimizer=opt: the
    host snapshot taken during the next forward/backward; the next opt.step() waits for it) or
    "device" (a same-device copy); save.Snapshot, or a mode registered in snapshot_modes.
    optimizer= with "host" is a ValueError (it would go unused); with "device" it is accepted and
    unused. overlap=True: the earlier spelling of snapshot="overlap". Where none of snapshot=,
    overlap= and optimizer= is given and one optimizer's step alone changes every tensor of the
    state (the optimizer `state` holds itself, or, for state_dict()s taken afresh, the one that
    stepped in this process whose parameters and moments they are: overlap.fencing_optimizer),
    the save overlaps with it as optimizer= would; else it takes the host snapshot. overlap=False (or
    snapshot="host") keeps the host snapshot. pool_bytes: the host pool's bound for this save (None: the state's
    logical size, chunk by chunk rounded up to 4 KiB). wait=False: SaveInFlightError if an
    earlier save_async is unfinished. memory: the memory tier's target for this save (the
    Checkpointer's, memory=True): the compressed snapshot goes into its shared memory instead of
    the pool, the future completes once that copy is committed (io_path "memory"), and no file
    is written (the Checkpointer writes it from the copy when a local step is due). save_options: codec, chunk_bytes, ring_depth, io,
    io_threads, backend, as for gdsckpt.save.
    Raised here: an unsupported state (before anything is copied), bad options, an earlier
    unseen background failure (BackgroundSaveError), and errors of the snapshot itself.
    """
    mode, optimizer = _mode_of(state, snapshot, overlap, optimizer)
    if memory is not None and pool_bytes is not None:
        raise ValueError("memory= takes the compressed snapshot into the memory tier, not the pool: not with pool_bytes=")
    check_pool_bytes(pool_bytes)
    options = SaveOptions(**save_options)
    t0 = time.perf_counter()
    target = save_target(user_path(path, "save_async"))  # a bad path is refused here, before any copy
    skeleton, leaves = flatten(state, saving=True)  # validates the whole state before anything is copied; the only walk
    if mode is _INFERRED:
        mode, optimizer = inferred_overlap(state, [l.tensor for l in leaves])
    if not _calls.acquire(blocking=wait):
        raise SaveInFlightError(f"a save_async is still in flight; not saving {str(path)!r} "
                                "(call .result() on its future first, or pass wait=True)")
    try:
        if not wait and any(not f.done() for f, _, _ in _tracked):  # before waiting for a snapshot
            raise SaveInFlightError(f"a save_async is still in flight; not saving {str(path)!r} "
                                    "(call .result() on its future first, or pass wait=True)")
        wait_for_snapshot()
        _surface_failures(path)
        if memory is not None:
            dest = memory.destination(target, options)
        else:
            dest = PoolDestination(target, pool_bytes or default_pool_limit, options.chunk_bytes)
        call = _Call(skeleton, leaves, dest, str(getattr(mode.name, "value", mode.name)), optimizer, options, t0,
                     str(path), first_copy=memory is None)
        fut = mode.save(call)
        _tracked.append((fut, call.mode, str(path)))
        return fut
    finally:
        _calls.release()


_INFERRED = object()  # _mode_of's answer where the state's own optimizer decides, once the state is walked


def _mode_of(state, snapshot, overlap, optimizer):
    """save_async's mode and optimizer from its arguments: snapshot= (None: the default), the
    earlier spelling overlap=True, or, where neither is given nor optimizer=, (_INFERRED, the
    optimizer in `state`) for inferred_overlap to decide once the state's tensors are known."""
    if snapshot is None and overlap is None and optimizer is None:
        return _INFERRED, None  # decided once the state's tensors are known (inferred_overlap)
    mode = snapshot_modes.lookup(Snapshot.HOST if snapshot is None else snapshot, snapshot_modes.SAVE_ASYNC)
    if overlap:  # the earlier spelling of snapshot="overlap"
        overlapped = snapshot_modes.lookup(Snapshot.OVERLAP, snapshot_modes.SAVE_ASYNC)
        snapshot_modes.check_optimizer(overlapped, optimizer, "save_async")
        if mode.name != Snapshot.HOST:
            raise ValueError(f"overlap=True takes the host snapshot; snapshot={str(snapshot)!r} is another mode")
        mode = overlapped
    snapshot_modes.check_optimizer(mode, optimizer, "save_async")
    return mode, optimizer


def inferred_overlap(state, tensors: list):
    """(mode, optimizer) of a save that named no mode nor optimizer: "overlap" with the optimizer
    whose step alone changes every tensor of the state (the one the state holds itself, or the one
    that stepped whose parameters and moments the state's state_dict()s are: fencing_optimizer),
    so that its step pre-hook fences everything the background snapshot reads; else ("host",
    None), the plain default."""
    optimizer = fencing_optimizer(state, tensors)
    if optimizer is not None:
        return snapshot_modes.lookup(Snapshot.OVERLAP, snapshot_modes.SAVE_ASYNC), optimizer
    return snapshot_modes.lookup(Snapshot.HOST, snapshot_modes.SAVE_ASYNC), None


class _Call:
    """snapshot_modes.SaveCall of one save_async: the ways a mode may take its snapshot."""

    def __init__(self, skeleton, leaves: list[Leaf], dest: SnapshotDestination, mode: str, optimizer,
                 options: SaveOptions, t0: float, label: str, first_copy: bool):
        self.skeleton, self.leaves, self.dest, self.mode = skeleton, leaves, dest, mode
        self.optimizer, self.options, self.t0, self.label = optimizer, options, t0, label
        self.tensors = [l.tensor for l in leaves]
        self._first_copy = first_copy

    def take(self) -> SaveFuture:
        fut = _new_future()
        with on_device(cuda_device_of(self.tensors)):
            snap = save_flat(self.skeleton, self.leaves, self.dest, self.options)  # on error: raised here, the room freed
        _link(fut, self.dest, snap, Snapshot.HOST.value, self.t0, time.perf_counter() - self.t0)
        return fut

    def in_background(self, keep, optimizer) -> SaveFuture:
        tensors = freeze(self.tensors, keep)
        frozen = [l if l.tensor is t else Leaf(l.key, t) for l, t in zip(self.leaves, tensors)]
        return self._background(frozen, cuda_device_of(tensors), optimizer)

    def copied(self, block=None) -> SaveFuture | None:
        return self._copied(cuda_device_of(self.tensors), block)

    def copy_first(self) -> SaveFuture | None:
        if not self._first_copy:
            return None
        gpu = copy_first(self.tensors)
        return None if gpu is None else self._copied(gpu, outside_cache)

    def _copied(self, gpu: int | None, block) -> SaveFuture | None:
        """The state copied on its GPU (snapshot_tensors' block: a first save's from CUDA's
        stream-ordered allocator, device mode's from torch's cache), then the host snapshot taken
        from the copy on a background thread, as an overlapped one is (growing the pool there, if
        it must); the copy goes back once that thread has ended. The call blocks for the copy
        alone, and no optimizer step waits. None where CUDA had no room for the copy."""
        try:
            copies = snapshot_tensors(self.tensors, block=block)
        except (RuntimeError, MemoryError):  # CUDA's out of memory, or a device without memory pools
            return None
        copied = block_bytes(c for c in copies if c.is_cuda)
        return self._background([Leaf(l.key, c) for l, c in zip(self.leaves, copies)], gpu, None, copied)

    def _background(self, frozen: list[Leaf], gpu: int | None, optimizer, copied: int = 0) -> SaveFuture:
        """The host snapshot of `frozen` on a background thread (overlap.run_overlapped; with an
        optimizer, its next step waits for it); the call's time so far is what it blocked."""
        fut = _new_future()
        hook = HookTimer() if optimizer is not None else None
        blocked = time.perf_counter() - self.t0
        skeleton, dest, options, mode, t0 = self.skeleton, self.dest, self.options, self.mode, self.t0

        def finish(snap, error):
            if error is not None:
                fut.set_exception(error)
            else:
                _link(fut, dest, snap, mode, t0, blocked, hook, copied)

        held = [frozen]

        def snapshot():
            leaves = held.pop()  # a copy's memory goes back as this returns, before the next save may start
            return save_flat(skeleton, leaves, dest, options)

        run_overlapped(snapshot, gpu, optimizer, finish, hook)
        return fut


def _link(fut: SaveFuture, dest: SnapshotDestination, snap: Stats, mode: str, t0: float, blocked: float,
          hook: HookTimer | None = None, copied: int = 0) -> None:
    """Complete `fut` when the bytes are where they go: the file committed by the writer, or the
    memory copy committed (or failed)."""

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
        fig = dest.figures(report)
        base = _stats_fields(snap)
        base.update(path=dest.label, io_path=fig.io_path, file_bytes=fig.file_bytes, seconds=time.perf_counter() - t0,
                    memory=dict(snap.memory, pinned_host_bytes=fig.pinned_bytes, pool_host_bytes=fig.host_bytes))
        stats = AsyncStats(**base, mode=mode, blocked_s=blocked, snapshot_s=snap.seconds,
                           queued_s=report.queued_s, background_s=report.background_s, write_s=report.write_s,
                           fsync_s=report.fsync_s, commit_s=report.commit_s, direct_io=report.direct_io,
                           pool_bytes=fig.host_bytes, pool_peak_bytes=fig.peak_bytes, pool_limit_bytes=fig.limit_bytes,
                           pool_waits=fig.waits, pool_wait_s=fig.wait_s, pool_alloc_s=fig.alloc_s,
                           device_copy_bytes=copied)
        if hook is not None:
            with hook.lock:
                stats.hook_wait_s = hook.waited
                hook.stats = stats
        return stats

    dest.done.add_done_callback(done)


# ---------------------------------------------------------------- helpers


def _stats_fields(stats: Stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(Stats)}


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

