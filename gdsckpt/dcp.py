"""torch.distributed.checkpoint storage plugin: each rank saves through gdsckpt, PyTorch plans.

    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import GdsckptWriter, GdsckptReader

    dcp.save(state_dict, storage_writer=GdsckptWriter("/ckpt/step100"))
    dcp.load(state_dict, storage_reader=GdsckptReader("/ckpt/step100"))
    fut = dcp.async_save(state_dict, storage_writer=GdsckptWriter("/ckpt/step200"),
                         planner=CachedSavePlanner())  # every save after the first skips DCP's plan exchange

A checkpoint is a directory: one gdsckpt file per rank that had something to write,
`__{rank}_0.gdsckpt`, holding all of that rank's write items (tensors from the device they
are on, so a rank's GPU shards are compressed by its own GPU; byte items as uint8 tensors),
and DCP's own `.metadata` (DCP's Metadata object, pickled as FileSystemWriter does). Each
item's storage_data is a plain dict {"file": name, "key": key}: nothing of ours is pickled,
and planning, deduplication and resharding stay with PyTorch's planners.

Commit point: `.metadata`. DCP calls `finish` on the coordinator only after every rank's
`write_data` succeeded (an exception on any rank is gathered and raised as a
CheckpointException on every rank, and `finish` does not run). When overwriting, the
coordinator removes the old `.metadata` before any rank writes, so a failed overwrite leaves
no committed checkpoint rather than old metadata over a mix of old and new files. `finish`
writes `.metadata` to a temporary, fsyncs it, renames it and fsyncs the directory; every
rank file is already durable (gdsckpt.save fsyncs and renames), so the checkpoint is durable
once dcp.save returns.

Loading reads each file's index once and only the chunks of the tensors the rank needs; a
read item that covers a whole stored tensor is decoded straight into the target shard's
memory (its GPU memory for GPU shards), others are read into a temporary on the target's
device and the requested slice copied in.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import re
import uuid
import weakref
from concurrent.futures import Future as ConcurrentFuture
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import api
from .async_save import (memory_of, optimizer_memory, run_overlapped, snapshot_tensors,
                         wait_for_snapshot)
from .defaults import RING_DEPTH
from .dtypes import name_of
from .errors import CheckpointExistsError, CheckpointFormatError, DCPPlanError, UnsupportedStateError
from .host_snapshot import PoolDestination
from .storage import fsync_dir

__all__ = ["GdsckptWriter", "GdsckptReader", "CachedSavePlanner", "DCP_VERSION", "METADATA_FILE", "SUFFIX"]

METADATA_FILE = ".metadata"  # DCP's name for it: FileSystemReader finds it there too
SUFFIX = ".gdsckpt"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION in torch 2.4-2.13
_RANK_FILE = re.compile(r"^__\d+_\d+" + re.escape(SUFFIX) + "$")


def item_key(index: MetadataIndex) -> str:
    """The gdsckpt key of a write item: its FQN, and for tensors the chunk's offset in the
    global tensor (one rank may hold several chunks of one FQN)."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _metadata_path(root: Path, rank: int | None) -> Path:
    return root / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")


def _cuda_device(tensors) -> int | None:
    for t in tensors:
        if t.is_cuda:
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return None


def _settle(tensors) -> None:
    """Wait for work the caller queued on its current CUDA stream(s), which may still be writing
    these tensors (gdsckpt's ring runs on its own stream)."""
    for dev in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


class _OnDevice:
    """Make `index` the current CUDA device (gdsckpt's GPU backend works on the current one;
    DCP's async save runs write_data on a thread whose current device is 0)."""

    def __init__(self, index: int | None):
        self.ctx = torch.cuda.device(index) if index is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


class CachedSavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner with its plan caching on, and stricter about when a cached plan
    may be reused.

    Without caching, every save gathers each rank's pickled plan (a write item per tensor) on
    the coordinator and scatters the global plan back. Under dcp.async_save that runs in the
    training process's background thread, holding the GIL: with 1,748 tensors per rank on 2x
    H200, ~0.5 s of GIL per save, which the first training step after the save lost
    (py-spy --gil, bench/results/2026-11-23-h200x2-gil/). With caching, a rank whose plan is
    unchanged sends an empty plan and every rank reuses its cached final plan.

    DCP decides "unchanged" from keys, offsets and sizes only (torch 2.11-2.13), so a tensor
    whose dtype changed would be saved under a cached plan and metadata naming the old dtype.
    Here a cached plan is reused only if every write item is equal, dtype, layout and all;
    otherwise the rank sends its full plan, as on a first save.

    DCP keeps its caches per process and key, and a cached final plan holds the storage
    writer's own data (GdsckptWriter's file prefix): saves through another storage writer
    (FileSystemWriter for exports, say) need a planner with another `cache_key`, or they would
    be handed this writer's plans."""

    def __init__(self, cache_key: str = "GdsckptWriter", **kwargs: Any):
        super().__init__(enable_plan_caching=True, **kwargs)
        self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is None or cached.items != self.plan.items:
                self._pending_local_plan = self.plan  # cached once the global plan succeeds
                return self.plan
        return plan


class GdsckptWriter(StorageWriter, AsyncStager):
    """StorageWriter for dcp.save / dcp.async_save: one gdsckpt file per rank.

    path: the checkpoint directory (created if missing; the checkpoint_id passed to dcp.save
    replaces it). overwrite: replace a checkpoint already in the directory (its `.metadata` is
    removed before any rank writes, and its rank files that the new checkpoint does not use
    are removed after it commits); False raises instead. codec, chunk_bytes, ring_depth, io,
    io_threads, backend: passed to gdsckpt.save (backend None: the GPU when a rank's items
    include CUDA tensors and the GPU backend is usable, else the CPU).

    As dcp.async_save's stager (used when no async_stager is passed), `async_staging`
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
    - "device" copies each tensor on its own device (GPU shards device-to-device on a side
      stream, synchronized before dcp.async_save returns), so the background save still
      compresses on the GPU; it costs one full copy of the rank's state on its GPU.
    - "cpu" stages to host memory as DCP's default stager does (no GPU memory; the background
      save then compresses on the CPU).
    After dcp.async_save returns the state dict is safe to mutate; wait on its future before
    the next save to the same directory.

    optimizer=opt (with async_staging="host"): the compressed snapshot is taken during the next
    forward/backward, as gdsckpt.save_async(..., overlap=True, optimizer=opt) takes it, under
    the same contract (gdsckpt/async_save.py): tensors of the state dict that share memory with
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
                 io_threads: int | None = None, backend: str | None = None, async_staging: str = "host",
                 optimizer=None):
        super().__init__()
        if async_staging not in ("host", "device", "cpu"):
            raise ValueError(f"async_staging must be 'host', 'device' or 'cpu', not {async_staging!r}")
        if optimizer is not None and async_staging != "host":
            raise ValueError(f"optimizer= overlaps the compressed host snapshot with training; async_staging="
                             f"{async_staging!r} copies the state before dcp.async_save returns")
        if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
            raise ValueError(f"optimizer= must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.path = Path(path)
        self.overwrite = overwrite
        self.save_options = dict(codec=codec, chunk_bytes=chunk_bytes, ring_depth=ring_depth, io=io,
                                 io_threads=io_threads, backend=backend)
        self.async_staging = async_staging
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self.last_stats: api.Stats | None = None  # this rank's gdsckpt.save Stats from the last write_data
        self._staged = [None]  # async_staging="host": (destination, {stand-in address: key}, {key: shape}, stats)
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
        return _metadata_path(self.path, None if self.use_collectives or self.rank is None else self.rank)

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
        self._uncommit(_metadata_path(self.path, None))
        return [p if p.storage_data is not None else dataclasses.replace(p, storage_data=f"__{i}_")
                for i, p in enumerate(plans)]

    def _uncommit(self, meta: Path) -> None:
        if meta.exists():
            meta.unlink()
            fsync_dir(self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            raise DCPPlanError(f"the save plan has no file prefix from GdsckptWriter (got {prefix!r}): was "
                               "prepare_global_plan skipped?")
        name = f"{prefix}0{SUFFIX}"
        if self._staged[0] is not None:
            items = [(item, planner.resolve_data(item)) for item in plan.items]  # resolved once: DCP's thread holds the GIL
            if self._plan_is_staged(items):
                return self._write_staged(items, prefix)
            _drop_staged(self._staged)  # staged by an async_save whose write never came; this is another save
        state: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = item_key(item.index)
            if key in state:
                raise DCPPlanError(f"two write items share the key {key!r}")
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                t = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else \
                    torch.empty(0, dtype=torch.uint8)
            else:
                if not isinstance(data, torch.Tensor):
                    raise UnsupportedStateError(f"write item {key!r} resolved to {type(data).__name__}, not a tensor")
                t = data.detach()
            state[key] = t
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": name, "key": key}))
        self.last_stats = None
        if state:
            _settle(state.values())
            with _OnDevice(_cuda_device(state.values())):
                self.last_stats = api.save(state, self.path / name, **self.save_options)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.version = DCP_VERSION  # as FileSystemWriter: the object dcp.save returns is the one stored
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        final = self._own_metadata()
        tmp = final.with_name(f"{final.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                pickle.dump(metadata, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path)
        if self.use_collectives:  # old rank files the new checkpoint does not use (a larger world before)
            used = {sd["file"] for sd in storage_md.values() if isinstance(sd, dict)}
            for p in self.path.iterdir():
                if _RANK_FILE.match(p.name) and p.name not in used:
                    p.unlink(missing_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _local_dir_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def _plan_is_staged(self, items: list) -> bool:
        """All of the plan's tensors (items: (write item, its resolved data)) are stage()'s
        stand-ins (True) or none is (another save: False). A mix would write stand-ins, which
        hold no data, as if they were the state: refused."""
        keys = self._staged[0][1]
        found = [isinstance(data, torch.Tensor) and _address(data) in keys
                 for item, data in items if item.type != WriteItemType.BYTE_IO]
        if any(found) and not all(found):
            raise DCPPlanError(f"{found.count(False)} of the plan's {len(found)} tensors are not the ones this "
                               "writer's stage() compressed; refusing to write stand-ins as data")
        return all(found)

    def _write_staged(self, items: list, prefix: str) -> Future:
        """write_data after a compressed `stage`: the tensor items are in the pool already; the
        byte items (pickled plain values, small) go to a second file through gdsckpt.save."""
        staged, self._staged[0] = self._staged[0], None
        dest, keys, shapes, snap, _ = staged
        name, bytes_name = f"{prefix}0{SUFFIX}", f"{prefix}1{SUFFIX}"
        submitted = False
        try:
            byte_state: dict[str, torch.Tensor] = {}
            results: list[WriteResult] = []
            for item, data in items:
                if item.type == WriteItemType.BYTE_IO:
                    key = item_key(item.index)
                    buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                    byte_state[key] = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else \
                        torch.empty(0, dtype=torch.uint8)
                    results.append(WriteResult(index=item.index, size_in_bytes=buf.nbytes,
                                               storage_data={"file": bytes_name, "key": key}))
                    continue
                key = keys.get(_address(data)) if isinstance(data, torch.Tensor) else None
                if key is None or tuple(data.shape) != shapes[key]:
                    raise DCPPlanError(f"write item {item_key(item.index)!r} is not a tensor this writer's stage() "
                                       "compressed (async_staging='host' stages whole tensors and DTensor shards)")
                results.append(WriteResult(index=item.index, size_in_bytes=data.numel() * data.element_size(),
                                           storage_data={"file": name, "key": key}))
            self.last_stats = None
            if any(r.storage_data["file"] == name for r in results):
                submitted = True
                report = dest.submit(self.path / name).done.result()
                self.last_stats = dataclasses.replace(
                    snap, path=str(self.path / name), file_bytes=dest.layout.file_bytes,
                    io_path="pool-direct" if report.direct_io else "pool-buffered")
            if byte_state:
                stats = api.save(byte_state, self.path / bytes_name,
                                 **dict(self.save_options, backend="cpu", io="auto", io_threads=None))
                self.last_stats = self.last_stats or stats
        finally:
            if not submitted:
                dest.job.drop()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def __getstate__(self):
        if self._staged[0] is not None or self.optimizer is not None:
            raise DCPPlanError("GdsckptWriter(async_staging='host') keeps the staged checkpoint in this process's "
                               "host pool, which another process cannot reach: use AsyncCheckpointerType.THREAD, or "
                               "async_staging='cpu' with the PROCESS executor")
        return self.__dict__

    # -- AsyncStager (dcp.async_save)
    def stage(self, state_dict):
        if self.async_staging == "host":
            wait_for_snapshot()  # an overlapped staging still running owns the ring and the pool
            _drop_staged(self._staged)  # an earlier staging that no write_data took
            if self.optimizer is not None:
                return self._stage_overlapped(state_dict)
            state, staged = stage_compressed(state_dict, self.save_options)
            self._staged[0] = staged
            return state
        if self.async_staging == "cpu":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)
            finally:
                stager.close()
        return snapshot_state_dict(state_dict)

    def _stage_overlapped(self, state_dict) -> ConcurrentFuture:
        guarded = optimizer_memory(self.optimizer)
        frozen = snapshot_state_dict(state_dict, keep=lambda t: memory_of(t) in guarded)
        staging: ConcurrentFuture = ConcurrentFuture()
        staging.set_running_or_notify_cancel()

        def finish(result, error):
            if error is not None:
                staging.set_exception(error)
            else:
                state, self._staged[0] = result
                staging.set_result(state)

        # the snapshot reads in place only the optimizer's memory: its GPU is the one to fence
        gpu = next((device.index for device, _ in guarded if device.type == "cuda"), None)
        run_overlapped(lambda: stage_compressed(frozen, self.save_options), gpu, self.optimizer, finish)
        return staging

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class GdsckptReader(StorageReader):
    """StorageReader for dcp.load of a checkpoint written by GdsckptWriter.

    backend, io, io_threads, ring_depth: passed to gdsckpt.open (backend None: the GPU when
    a target is a CUDA tensor or a chunk needs nvCOMP, else the CPU).
    """

    def __init__(self, path: str | os.PathLike, *, backend: str | None = None, io: str = "auto",
                 io_threads: int | None = None, ring_depth: int = RING_DEPTH):
        super().__init__()
        self.path = Path(path)
        self.open_options = dict(backend=backend, io=io, io_threads=io_threads, ring_depth=ring_depth)
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.use_collectives = True
        self.last_stats: list[api.Stats] = []  # one per gdsckpt read of the last read_data

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = _metadata_path(self.path, kwargs.get("rank"))
        # DCP's own metadata file, unpickled exactly as DCP's FileSystemReader does.
        with open(path, "rb") as f:
            metadata = pickle.load(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointFormatError("the DCP metadata has no storage_data", path=self.path)
        bad = next((v for v in metadata.storage_data.values()
                    if not (isinstance(v, dict) and isinstance(v.get("file"), str) and isinstance(v.get("key"), str))),
                   None)
        if bad is not None:
            raise CheckpointFormatError(
                f"this checkpoint was not written by GdsckptWriter (an item's storage data is "
                f"{type(bad).__name__}); read it with the StorageReader that wrote it, e.g. FileSystemReader",
                path=self.path)
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[tuple[ReadItem, str]]] = defaultdict(list)
        for ri in plan.items:
            sd = self.storage_data[ri.storage_index]
            name = sd["file"]
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                raise CheckpointFormatError(f"the metadata names a file outside the checkpoint: {name!r}",
                                            path=self.path)
            per_file[name].append((ri, sd["key"]))
        self.last_stats = []
        for name, reqs in per_file.items():
            with api.open(self.path / name, **self.open_options) as ck:
                self._read_file(ck, reqs, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, ck: api.Checkpoint, reqs, planner: LoadPlanner) -> None:
        for _, key in reqs:
            if key not in ck:
                raise CheckpointFormatError("the DCP metadata names a key the file does not hold",
                                            path=ck.path, key=key)
        # Byte items (pickled non-tensor values, as DCP's planner made them): host memory.
        byte_reqs = [(ri, k) for ri, k in reqs if ri.type == LoadItemType.BYTE_IO]
        if byte_reqs:
            got = ck.read(sorted({k for _, k in byte_reqs}), "cpu")
            self._stats(ck)
            for ri, k in byte_reqs:
                planner.load_bytes(ri, io.BytesIO(got[k].numpy().tobytes()))
        # Tensor items: resolve every target first, then read per stored tensor.
        by_stored: dict[str, list[tuple[ReadItem, torch.Tensor]]] = defaultdict(list)
        for ri, k in reqs:
            if ri.type != LoadItemType.BYTE_IO:
                by_stored[k].append((ri, planner.resolve_tensor(ri).detach()))
        direct: dict[str, torch.Tensor] = {}
        staged: dict[torch.device, list[str]] = defaultdict(list)
        for i, items in by_stored.items():
            e = ck.info(i)
            ri, target = items[0]
            whole = (len(items) == 1 and all(int(o) == 0 for o in ri.storage_offsets)
                     and tuple(int(n) for n in ri.lengths) == tuple(e["shape"]))
            if (whole and tuple(target.shape) == tuple(e["shape"]) and name_of(target.dtype) == e["dtype"]
                    and target.device.type in ("cpu", "cuda") and target.layout == torch.strided):
                direct[i] = target  # decoded straight into the target shard's memory
            else:
                staged[items[0][1].device].append(i)
        if direct:
            _settle(direct.values())  # nothing queued before may land on the shards after the decode
            with _OnDevice(_cuda_device(direct.values())):
                ck.read_into(direct)
            self._stats(ck)
            for i in direct:
                ri, target = by_stored[i][0]
                planner.commit_tensor(ri, target)
        for device, idx in staged.items():
            dev = device if device.type in ("cpu", "cuda") else torch.device("cpu")
            with _OnDevice(dev.index if dev.type == "cuda" else None):
                got = ck.read(idx, dev)
            self._stats(ck)
            for i in idx:
                for ri, target in by_stored[i]:
                    src = _narrow(got[i], ri.storage_offsets, ri.lengths)
                    if tuple(src.shape) != tuple(target.shape):
                        raise CheckpointFormatError(
                            f"read item {ri.storage_index} is {list(src.shape)} in the checkpoint but the target "
                            f"is {list(target.shape)}", path=ck.path, key=i)
                    target.copy_(src)
                    planner.commit_tensor(ri, target)
                del got[i]

    def _stats(self, ck: api.Checkpoint) -> None:
        if ck.last_stats is not None:
            self.last_stats.append(ck.last_stats)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _local_dir_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, int(o), int(n))
    return t


def _local_dir_id(checkpoint_id) -> bool:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    s = os.fspath(checkpoint_id)
    if isinstance(s, bytes) or "://" in s:
        return False
    p = Path(s)
    return not p.exists() or p.is_dir()


class _StandInElements:
    """The one element behind each stand-in: a distinct element of a block per (dtype,
    device), so that no two stand-ins share a data address (write_data finds each one's key
    by it) while a staging of thousands of tensors allocates a few blocks, not a tensor
    (and, on a GPU, a kernel) each. Kept alive with the staging."""

    BLOCK = 4096

    def __init__(self):
        self.blocks: list[torch.Tensor] = []  # all of them: a freed block's addresses could come back
        self.current: dict[tuple, list] = {}  # (dtype, device) -> [block, elements used]

    def take(self, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> torch.Tensor:
        entry = self.current.get((dtype, device))
        if entry is None or entry[1] == self.BLOCK:
            self.blocks.append(torch.zeros(self.BLOCK, dtype=dtype, device=device))
            entry = self.current[(dtype, device)] = [self.blocks[-1], 0]
        one = entry[0][entry[1]:entry[1] + 1]
        entry[1] += 1
        # a stand-in of a parameter requires grad as the parameter does
        return one.detach().requires_grad_(True) if requires_grad else one


def _address(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data starts, also for one of no elements (whose data_ptr() is 0)."""
    return t.untyped_storage().data_ptr(), t.storage_offset()


def _dtensor_like(d, local: torch.Tensor):
    """A DTensor of `d`'s global shape, mesh and placements over `local`. DTensor's own
    constructor with d's (immutable) spec: DTensor.from_local re-derives and validates the
    spec through an autograd Function, ~0.1 ms a tensor, most of a 1,748-tensor staging's
    Python time (bench/probes/dcp_stage_profile.py); from_local where that constructor differs."""
    from torch.distributed.tensor import DTensor
    try:
        return DTensor(local, d._spec, requires_grad=local.requires_grad)
    except (AttributeError, TypeError):
        return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())


def _drop_staged(box: list) -> None:
    staged, box[0] = box[0], None
    if staged is not None:
        staged[0].job.drop()


def stage_compressed(state_dict, save_options: dict):
    """Compress the tensors of a DCP state dict (DTensor local shards, plain tensors) into this
    process's host pool, as save_async does; return (stand-in state dict, staged) where the
    stand-ins have the shapes, dtypes and DTensor placements of the tensors but hold no memory
    (one element, expanded), other values are deep-copied, and `staged` is
    (PoolDestination with the records, {stand-in _address: key}, {key: shape}, Stats, the
    stand-ins' element blocks)."""
    from torch.distributed.tensor import DTensor

    tensors: dict[str, torch.Tensor] = {}
    keys: dict[tuple[int, int], str] = {}  # _address of a stand-in -> its key
    shapes: dict[str, tuple] = {}
    elements = _StandInElements()

    def stand_in(t: torch.Tensor, path: str) -> torch.Tensor:
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or t.is_quantized:
            raise UnsupportedStateError(f"cannot stage a {t.layout} {t.dtype} tensor on {t.device} at {path!r}; "
                                        "pass async_staging='cpu' to GdsckptWriter")
        key = path
        while key in tensors:
            key += "#"
        tensors[key] = t.detach()
        shapes[key] = tuple(t.shape)
        # On the tensor's own device: DTensor.from_local moves a local tensor that is not on the
        # mesh's device type, and write_data would then not recognise the copy as staged.
        one = elements.take(t.dtype, t.device, t.requires_grad and (t.is_floating_point() or t.is_complex()))
        keys[_address(one)] = key
        return one.reshape(()).expand(t.shape)

    def rebuild(o, path: str, depth: int):
        if depth > 512:
            raise UnsupportedStateError("state dict is nested deeper than 512 levels (or cyclic)")
        if isinstance(o, DTensor):
            return _dtensor_like(o, stand_in(o.to_local(), path))
        if isinstance(o, torch.Tensor):
            return stand_in(o, path)
        sep = "/" if path else ""
        if isinstance(o, dict):
            items = [(k, rebuild(v, f"{path}{sep}{k}", depth + 1)) for k, v in o.items()]
            return OrderedDict(items) if isinstance(o, OrderedDict) else dict(items)
        if isinstance(o, list):
            return [rebuild(v, f"{path}{sep}{i}", depth + 1) for i, v in enumerate(o)]
        if isinstance(o, tuple):
            items = [rebuild(v, f"{path}{sep}{i}", depth + 1) for i, v in enumerate(o)]
            return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        if type(o).__name__ == "ShardedTensor":
            raise UnsupportedStateError("ShardedTensor cannot be staged compressed; pass async_staging='cpu' "
                                        "to GdsckptWriter")
        if isinstance(o, (bool, int, float, complex, str, bytes, type(None))):
            return o
        return copy.deepcopy(o)

    state = rebuild(state_dict, "", 0)
    dest = PoolDestination(None, None, save_options.get("chunk_bytes"))
    with _OnDevice(_cuda_device(tensors.values())):
        snap = api._save(tensors, dest, **save_options)
    return state, (dest, keys, shapes, snap, elements)


def snapshot_state_dict(obj, keep=lambda t: False):
    """A private copy of a DCP state dict: tensors (plain or DTensor, whose local shards are
    copied on their own device) through `snapshot_tensors`, except those for which keep(local
    tensor) holds (kept as they are); containers rebuilt, any other object deep-copied. The
    "device" staging of GdsckptWriter, and the call-time part of its overlapped one."""
    from torch.distributed.tensor import DTensor

    found = _state_tensors(obj)
    kept = [keep(t) for t in found]  # decided once per tensor, in the order rebuild meets them
    copied = iter(snapshot_tensors([t for t, k in zip(found, kept) if not k]))
    decisions = iter(kept)

    def rebuild(o):
        if isinstance(o, DTensor):
            if next(decisions):
                return o
            return DTensor.from_local(next(copied), o.device_mesh, o.placements, run_check=False,
                                      shape=o.shape, stride=o.stride())
        if isinstance(o, torch.Tensor):
            if next(decisions):
                return o
            t = next(copied)
            return torch.nn.Parameter(t, o.requires_grad) if isinstance(o, torch.nn.Parameter) else t
        if isinstance(o, dict):
            items = [(k, rebuild(v)) for k, v in o.items()]
            return OrderedDict(items) if isinstance(o, OrderedDict) else dict(items)
        if isinstance(o, list):
            return [rebuild(v) for v in o]
        if isinstance(o, tuple):
            items = [rebuild(v) for v in o]
            return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        if isinstance(o, (bool, int, float, complex, str, bytes, type(None))):
            return o
        return copy.deepcopy(o)

    return rebuild(obj)


def _state_tensors(obj) -> list[torch.Tensor]:
    """The tensors of a DCP state dict in walk order (a DTensor's local shard), checked."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []

    def collect(o, depth=0):
        if depth > 512:
            raise UnsupportedStateError("state dict is nested deeper than 512 levels (or cyclic)")
        if isinstance(o, DTensor):
            found.append(o.to_local())
        elif isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.device.type not in ("cpu", "cuda") or o.is_quantized:
                raise UnsupportedStateError(f"cannot snapshot a {o.layout} {o.dtype} tensor on {o.device}; "
                                   "pass async_staging='cpu' to GdsckptWriter")
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v, depth + 1)
        elif type(o).__name__ == "ShardedTensor":
            raise UnsupportedStateError("ShardedTensor cannot be snapshotted on its device; "
                               "pass async_staging='cpu' to GdsckptWriter")

    collect(obj)
    return found
