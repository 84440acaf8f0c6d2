"""GdsckptWriter: torch.distributed.checkpoint's storage writer (and async stager) through gdsckpt.

A checkpoint is a directory: one gdsckpt file per rank that had something to write,
`__{rank}_0.gdsckpt`, holding all of that rank's write items (tensors from the device they
are on, so a rank's GPU shards are compressed by its own GPU; byte items as uint8 tensors),
and DCP's own `.metadata` (metadata.py). Each item's storage_data is a plain dict
{"file": name, "key": key}: nothing of ours is pickled, and planning, deduplication and
resharding stay with PyTorch's planners.

Commit point: `.metadata`. DCP calls `finish` on the coordinator only after every rank's
`write_data` succeeded (an exception on any rank is gathered and raised as a
CheckpointException on every rank, and `finish` does not run). When overwriting, the
coordinator removes the old `.metadata` before any rank writes, so a failed overwrite leaves
no committed checkpoint rather than old metadata over a mix of old and new files. `finish`
writes `.metadata` atomically (storage.atomic_file); every rank file is already durable
(save_flat into a NewFile fsyncs and renames), so the checkpoint is durable once dcp.save
returns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
import weakref
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from gdsckpt.writing.snapshot import modes as snapshot_modes
from gdsckpt.core.defaults import RING_DEPTH
from gdsckpt.engine.device_copy import (
    copy_first, cuda_device_of, may_copy_first, on_device, outside_cache, settle,
)
from ..errors import CheckpointExistsError, DCPPlanError, UnsupportedStateError
from gdsckpt.writing.snapshot.overlap import run_overlapped, wait_for_snapshot
from gdsckpt.writing.save import NewFile, SaveOptions, Snapshot, save_flat
from ..stats import Stats
from gdsckpt.core.storage import fsync_dir
from gdsckpt.format.tree import flatten
from .layout import DCP_VERSION, RANK_FILE, SUFFIX, item_key, local_dir_id, metadata_path
from .metadata import write_metadata
from .planner import CachedSavePlanner
from .results import PreparedWrite, RankResults, byte_tensor, prepare_write, reuse_write, storage_data_of
from .staging import Staged, data_address, snapshot_state_dict, stage_compressed, state_tensors

__all__ = ["GdsckptWriter"]

log = logging.getLogger("gdsckpt.dcp")
_warned_uncached = threading.Event()  # the warning about a planner without plan caching: said once per process


def _warn_uncached(planner) -> None:
    """Say once, loudly, what a dcp.async_save through GdsckptWriter costs without plan caching."""
    if isinstance(planner, CachedSavePlanner) or getattr(planner, "_enable_plan_caching", False) \
            or _warned_uncached.is_set():
        return
    _warned_uncached.set()
    log.warning("gdsckpt: dcp.async_save through GdsckptWriter with %s, which caches no plan: every save "
                "plans afresh and exchanges every rank's plan on DCP's background thread, holding the GIL "
                "beside the training (2-4x the GPU idle per checkpoint of the cached path). One-line fix: "
                "gdsckpt.dcp.async_save(state, path), or pass planner=gdsckpt.dcp.CachedSavePlanner() to "
                "dcp.async_save", type(planner).__name__)


def _staging_mode(snapshot, async_staging, optimizer):
    """GdsckptWriter's snapshot mode (snapshot_modes.SnapshotMode) from snapshot= or its earlier
    spelling async_staging= (where "host" with optimizer= means "overlap", as it always did); by
    default "overlap" where an optimizer is given, else "host"; optimizer= as
    snapshot_modes.check_optimizer takes it."""
    if async_staging is not None:
        if snapshot is not None:
            raise ValueError("snapshot= and async_staging= (its earlier spelling) name the same choice: pass one")
        Snapshot.parse(async_staging, (Snapshot.HOST, Snapshot.DEVICE, Snapshot.CPU), "async_staging")
        name = snapshot_modes.with_optimizer(async_staging) if optimizer is not None else async_staging
    elif snapshot is None:
        name = snapshot_modes.with_optimizer(Snapshot.HOST) if optimizer is not None else Snapshot.HOST
    else:
        name = snapshot
    mode = snapshot_modes.lookup(name, snapshot_modes.DCP)
    snapshot_modes.check_optimizer(mode, optimizer, "dcp.async_save")
    return mode


def _drop_staged(box: list) -> None:
    staged, box[0] = box[0], None
    if staged is not None:
        staged.drop()


class GdsckptWriter(StorageWriter, AsyncStager):
    """StorageWriter for dcp.save / dcp.async_save: one gdsckpt file per rank.

    path: the checkpoint directory (created if missing; the checkpoint_id passed to dcp.save
    replaces it). overwrite: replace a checkpoint already in the directory (its `.metadata` is
    removed before any rank writes, and its rank files that the new checkpoint does not use
    are removed after it commits); False raises instead. codec, chunk_bytes, ring_depth, io,
    io_threads, backend: passed to gdsckpt.save (backend None: the GPU when a rank's items
    include CUDA tensors and the GPU backend is usable, else the CPU).

    As dcp.async_save's stager (used when no async_stager is passed), `snapshot` (save.Snapshot,
    the names save_async takes; `async_staging=` is its earlier spelling and still works)
    decides where the snapshot lives:
    - "host" (default): the compressed snapshot of gdsckpt.save_async. `stage` compresses the
      rank's tensors (its DTensor shards, on their GPU) into this process's host pool (pinned
      memory; stored bytes, not logical) and returns a stand-in state dict (tensors of the
      right shapes and dtypes that hold no memory; other values deep-copied) for DCP to plan
      with; `write_data`, on DCP's background thread, has the writer thread write the pool's
      bytes to the rank file, fsync and commit it, and never touches the GPU. Extra GPU
      memory: the save ring. The pool holds the whole rank's stored bytes from `stage` until
      `write_data` (or until this writer stages again or is garbage collected). The file
      holds every staged tensor, also replicated ones DCP assigns to another rank. Works
      with AsyncCheckpointerType.THREAD (the default); the PROCESS executor cannot reach the
      pool (pickling the writer then raises; use "cpu" there).
    - "device" copies each tensor on its own device (GPU shards device-to-device, from torch's
      cache) before dcp.async_save returns, then takes the "host" staging from the copy on a
      background thread and lets the copy go (gdsckpt.save_async(snapshot="device") does the
      same): no optimizer step waits, at the cost of a copy of the rank's state on its GPU while
      it is compressed. `stage` returns a Future, as in "overlap"; THREAD executor only.
    - "cpu" stages to host memory as DCP's default stager does (no GPU memory; the background
      save then compresses on the CPU).
    After dcp.async_save returns the state dict is safe to mutate; wait on its future before
    the next save to the same directory.

    - "overlap" (optimizer=opt; the default when optimizer= is given): the compressed snapshot
    is taken during the next forward/backward, as gdsckpt.save_async(..., snapshot="overlap",
    optimizer=opt) takes it, under
    the same contract (gdsckpt/writing/async_save.py): tensors of the state dict that share memory with
    a parameter of `opt` or a tensor of its state (FSDP2's DTensor shards included) are read
    by the snapshot until it ends, and a step pre-hook makes the next `opt.step()` wait for
    it; every other tensor is copied, and every other value deep-copied, before
    dcp.async_save returns. `stage` then returns a Future, so dcp.async_save returns DCP's
    AsyncSaveResponse: `staging_completion` (the snapshot) and `upload_completion` (the
    checkpoint). THREAD executor only, as "host".
    """

    _synchronize_after_execute = False  # stage() is complete when it returns (or returns a Future)

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = True, codec="auto",
                 chunk_bytes: int | None = None, ring_depth: int = RING_DEPTH, io: str = "auto",
                 io_threads: int | None = None, backend: str | None = None, snapshot: str | None = None,
                 optimizer=None, async_staging: str | None = None):
        super().__init__()
        self.mode = _staging_mode(snapshot, async_staging, optimizer)
        self.snapshot = self.mode.name  # a save.Snapshot for the built-in modes
        self.optimizer = optimizer if self.mode.optimizer == "needed" else None  # only its step waits
        self.path = Path(path)
        self.overwrite = overwrite
        self.options = SaveOptions(codec=codec, chunk_bytes=chunk_bytes, ring_depth=ring_depth, io=io,
                                   io_threads=io_threads, backend=backend)
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self.last_stats: Stats | None = None  # this rank's save Stats from the last write_data
        self._staged: list[Staged | None] = [None]  # snapshot "host"/"overlap": the staging write_data writes
        # a staging that failed on this rank: write_data raises it, inside DCP's collectives, so
        # DCP reports it on every rank (raised in stage(), it would leave the others in a collective)
        self._stage_error: BaseException | None = None
        self._staged_async = False  # stage() ran for the coming write_data: a dcp.async_save
        weakref.finalize(self, _drop_staged, self._staged)

    # -- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _own_metadata(self) -> Path:
        return metadata_path(self.path, None if self.use_collectives or self.rank is None else self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        meta = self._own_metadata()
        if meta.exists() and not self.overwrite:
            raise CheckpointExistsError(f"a checkpoint is already committed in {str(self.path)!r} "
                               f"({meta.name} exists) and overwrite=False")
        if not self.use_collectives:
            if self.rank is None:
                raise DCPPlanError("use_collectives=False needs DCP to pass the rank to set_up_storage_writer")
            self._uncommit(meta)  # no coordinator: each rank retires its own metadata
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank}_")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator after every rank planned and before any rank writes.
        self._uncommit(metadata_path(self.path, None))
        return [p if p.storage_data is not None else dataclasses.replace(p, storage_data=f"__{i}_")
                for i, p in enumerate(plans)]

    def _uncommit(self, meta: Path) -> None:
        if meta.exists():
            meta.unlink()
            fsync_dir(self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        error, self._stage_error = self._stage_error, None
        if self._staged_async:  # dcp.async_save staged this save
            self._staged_async = False
            _warn_uncached(planner)
        if error is not None:
            raise error
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            raise DCPPlanError(f"the save plan has no file prefix from GdsckptWriter (got {prefix!r}): was "
                               "prepare_global_plan skipped?")
        name = f"{prefix}0{SUFFIX}"
        staged = self._staged[0]
        if staged is not None:
            prepared = reuse_write(plan, staged.layout, name, planner)  # a steady save: nothing to resolve
            if prepared is not None:
                return self._write_staged(prepared, [(item, planner.resolve_data(item)) for item in
                                                     prepared.byte_items], prefix)
            items = [(item, planner.resolve_data(item)) for item in plan.items]  # resolved once: DCP's thread holds the GIL
            if self._plan_is_staged(items):
                try:
                    prepared = prepare_write(plan, staged.layout, items, staged.keys, staged.shapes, name, planner)
                except BaseException:
                    _drop_staged(self._staged)
                    raise
                return self._write_staged(prepared, [(i, d) for i, d in items if i.type == WriteItemType.BYTE_IO],
                                          prefix)
            _drop_staged(self._staged)  # staged by an async_save whose write never came; this is another save
        state: dict[str, torch.Tensor] = {}
        written: list[WriteResult] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = item_key(item.index)
            if key in state:
                raise DCPPlanError(f"two write items share the key {key!r}")
            if item.type == WriteItemType.BYTE_IO:
                t = byte_tensor(data, item.index.fqn)
            else:
                if not isinstance(data, torch.Tensor):
                    raise UnsupportedStateError(f"write item {key!r} resolved to {type(data).__name__}, not a tensor")
                t = data.detach()
            state[key] = t
            written.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": name, "key": key}))
        self.last_stats = None
        if state:
            settle(state.values())
            skeleton, leaves = flatten(state)
            with on_device(cuda_device_of(state.values())):
                self.last_stats = save_flat(skeleton, leaves, NewFile(self.path / name), self.options)
        fut: Future = Future()
        fut.set_result(written)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = storage_data_of(results)
        metadata.version = DCP_VERSION  # as FileSystemWriter: the object dcp.save returns is the one stored
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        write_metadata(self._own_metadata(), metadata)  # the commit point: atomic and durable
        if self.use_collectives:  # old rank files the new checkpoint does not use (a larger world before)
            used = {sd["file"] for sd in storage_md.values() if isinstance(sd, dict)}
            for p in self.path.iterdir():
                if RANK_FILE.match(p.name) and p.name not in used:
                    p.unlink(missing_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return local_dir_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def _plan_is_staged(self, items: list) -> bool:
        """All of the plan's tensors (items: (write item, its resolved data)) are stage()'s
        stand-ins (True) or none is (another save: False). A mix would write stand-ins, which
        hold no data, as if they were the state: refused."""
        keys = self._staged[0].keys
        found = [isinstance(data, torch.Tensor) and data_address(data) in keys
                 for item, data in items if item.type != WriteItemType.BYTE_IO]
        if any(found) and not all(found):
            raise DCPPlanError(f"{found.count(False)} of the plan's {len(found)} tensors are not the ones this "
                               "writer's stage() compressed; refusing to write stand-ins as data")
        return all(found)

    def _write_staged(self, prepared: PreparedWrite, byte_items: list, prefix: str) -> Future:
        """write_data after a compressed `stage`: the tensor items are in the pool already (their
        results prepared); the byte items (byte_items: (write item, resolved data), pickled
        plain values, small) go to a second file through gdsckpt.save."""
        staged, self._staged[0] = self._staged[0], None
        dest, snap = staged.destination, staged.stats
        name, bytes_name = f"{prefix}0{SUFFIX}", f"{prefix}1{SUFFIX}"
        submitted = False
        try:
            byte_state: dict[str, torch.Tensor] = {}
            byte_results: list[WriteResult] = []
            for item, data in byte_items:
                key = item_key(item.index)
                byte_state[key] = byte_tensor(data, item.index.fqn)
                byte_results.append(WriteResult(index=item.index, size_in_bytes=byte_state[key].numel(),
                                                storage_data={"file": bytes_name, "key": key}))
            self.last_stats = None
            if prepared.tensor_results:
                submitted = True
                report = dest.submit(self.path / name).done.result()
                self.last_stats = dataclasses.replace(
                    snap, path=str(self.path / name), file_bytes=dest.deferred.file_bytes,
                    io_path="pool-direct" if report.direct_io else "pool-buffered")
            if byte_state:
                skeleton, leaves = flatten(byte_state)
                stats = save_flat(skeleton, leaves, NewFile(self.path / bytes_name),
                                  dataclasses.replace(self.options, backend="cpu", io="auto", io_threads=None))
                self.last_stats = self.last_stats or stats
        finally:
            if not submitted:
                dest.job.drop()
        fut: Future = Future()
        fut.set_result(RankResults(prepared.tensor_results, byte_results, prepared.byte_positions, prepared.pickled))
        return fut

    def __getstate__(self):
        if self._staged[0] is not None or self.optimizer is not None:
            raise DCPPlanError("GdsckptWriter(snapshot='host', 'overlap' or 'device') keeps the staged "
                               "checkpoint in this process's host pool, which another process cannot reach: use "
                               "AsyncCheckpointerType.THREAD, or snapshot='cpu' with the PROCESS executor")
        return self.__dict__

    # -- AsyncStager (dcp.async_save)
    def stage(self, state_dict):
        """The staged state dict (or its future). A staging that fails (the pinned pool cannot
        grow, ...) stages `state_dict` itself as a placeholder, which DCP only plans from: the
        error is raised by write_data, so every rank's save fails alike instead of one rank
        leaving the others in DCP's collectives."""
        self._stage_error = None
        self._staged_async = True
        try:
            staged = self._stage(state_dict)
        except Exception as e:
            self._stage_error = e
            return state_dict
        if isinstance(staged, ConcurrentFuture):  # a background staging: its failure too
            placeholder: ConcurrentFuture = ConcurrentFuture()
            placeholder.set_running_or_notify_cancel()

            def settle_placeholder(f):
                if f.exception() is None:
                    placeholder.set_result(f.result())
                else:
                    self._stage_error = f.exception()
                    placeholder.set_result(state_dict)
            staged.add_done_callback(settle_placeholder)
            return placeholder
        return staged

    def _stage(self, state_dict):
        if self.mode.uses_pool:
            wait_for_snapshot()  # an overlapped staging still running owns the ring and the pool
            _drop_staged(self._staged)  # an earlier staging that no write_data took
        return self.mode.stage(_StageCall(self, state_dict))

    def take_staged(self, state_dict):
        """The compressed staging of `state_dict` now (a StageCall's take): the stand-in state dict."""
        state, self._staged[0] = stage_compressed(state_dict, self.options)
        return state

    def stage_in_background(self, frozen, gpu: int | None, optimizer) -> ConcurrentFuture:
        """stage_compressed(frozen) on a background thread (overlap.run_overlapped: with an
        optimizer, its next step waits for it); the future of the stand-in state dict."""
        staging: ConcurrentFuture = ConcurrentFuture()
        staging.set_running_or_notify_cancel()

        def finish(result, error):
            if error is not None:
                staging.set_exception(error)
            else:
                state, self._staged[0] = result
                staging.set_result(state)

        held = [frozen]
        run_overlapped(lambda: stage_compressed(held.pop(), self.options), gpu, optimizer, finish)
        return staging

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StageCall:
    """snapshot_modes.StageCall of one GdsckptWriter.stage."""

    def __init__(self, writer: GdsckptWriter, state_dict):
        self.writer, self.state_dict, self.optimizer = writer, state_dict, writer.optimizer

    def take(self):
        return self.writer.take_staged(self.state_dict)

    def in_background(self, keep, optimizer) -> ConcurrentFuture:
        first: list[int] = []  # the first CUDA device met: the GPU whose work the snapshot fences

        def noted(t) -> bool:
            if not first and t.is_cuda:
                first.append(t.device.index if t.device.index is not None else torch.cuda.current_device())
            return keep(t)
        frozen = snapshot_state_dict(self.state_dict, keep=noted)
        return self.writer.stage_in_background(frozen, first[0] if first else None, optimizer)

    def copied(self, block=None) -> ConcurrentFuture | None:
        return self._copied(block, cuda_device_of(state_tensors(self.state_dict)))

    def copy_first(self) -> ConcurrentFuture | None:
        gpu = copy_first(state_tensors(self.state_dict)) if may_copy_first() else None
        return None if gpu is None else self._copied(outside_cache, gpu)

    def _copied(self, block, gpu: int | None) -> ConcurrentFuture | None:
        """The compressed staging from a copy of every tensor taken now (snapshot_tensors' `block`:
        a first staging's outside torch's cache, device mode's in it), as save_async's copies
        take it; no optimizer step waits. None where CUDA had no room for the copy."""
        try:
            frozen = snapshot_state_dict(self.state_dict, block=block)
        except (RuntimeError, MemoryError):  # CUDA's out of memory, or a device without memory pools
            return None
        return self.writer.stage_in_background(frozen, gpu, None)
